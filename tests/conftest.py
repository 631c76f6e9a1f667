"""Shared fixtures: a session-scoped Prefect test harness and a session-scoped Ray, both real.

Prefect's ephemeral mode is unusable with Ray (each Ray worker would start its own server), so the harness
provides a real API for the whole session, with flow heartbeats off (they cost ~1 s per sync subflow).
"""

import os
import tempfile

# homes of the session's own: a pytest-xdist worker (`-n N`; `make test` runs none) inherits the controller's
# environment, so it takes fresh ones, or the workers' runs would join each other's local Prefect server
_FRESH = "PYTEST_XDIST_WORKER" in os.environ
for _name, _prefix in (("PREFECT_HOME", "prefect-home-"), ("CHATLEARN_PREFECT_HOME", "chatlearn-prefect-")):
    if _FRESH or _name not in os.environ:
        os.environ[_name] = tempfile.mkdtemp(prefix=_prefix)
os.environ.pop("PREFECT_API_URL", None)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import resource  # noqa: E402

import pytest  # noqa: E402

# the suite's one process drives ~40 runs' clients, servers and Ray sessions in turn; where the soft open-files limit
# is below the hard one (1,024 on many machines), raise it, so a slow leak cannot fail tests that merely open a file
_soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if _hard == resource.RLIM_INFINITY or _soft < _hard:
    resource.setrlimit(resource.RLIMIT_NOFILE, (_hard if _hard != resource.RLIM_INFINITY else max(_soft, 65536), _hard))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAULT_VARIABLES = ("CHATLEARN_CRASH_AT", "CHATLEARN_FAULT_AT", "CHATLEARN_KILL_AT")


def chatlearn_train(args, out, tiny_model_dir, timeout: float = 600, cwd: str | None = None, api_url: str | None = "",
                    **variables):
    """A real `chatlearn train ARGS` process writing under ``out``, on the session's Prefect API (use with the
    ``prefect_api`` fixture), with the fault-injection variables (chatlearn/utils/faults.py,
    chatlearn/runtime/calls/recovery.py) cleared unless given in ``variables``. From the repository root, or with
    ``cwd`` the installed console script run there, as a user runs it (``python -m`` would put ``cwd`` on
    ``sys.path`` and hide whether user code resolves without it). ``api_url``: another Prefect API, or None for
    none (the command starts or joins the local server of ``CHATLEARN_PREFECT_HOME``)."""
    import subprocess
    import sys

    from prefect.settings import PREFECT_API_URL

    env = dict(os.environ, CHATLEARN_OUTPUT_DIR=str(out), CHATLEARN_TINY_MODEL_DIR=tiny_model_dir,
               PREFECT_API_URL=PREFECT_API_URL.value() if api_url == "" else api_url or "")
    if api_url is None:
        env.pop("PREFECT_API_URL")
    for name in FAULT_VARIABLES:
        env.pop(name, None)
    env.update({k: v for k, v in variables.items() if v is not None})
    env.pop("PYTHONPATH", None)
    command = [os.path.join(os.path.dirname(sys.executable), "chatlearn")] if cwd else [sys.executable, "-m",
                                                                                        "chatlearn.cli"]
    return subprocess.run([*command, "train", *args], cwd=cwd or REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def train_here(args: list[str], out, tiny_model_dir: str, monkeypatch, **variables) -> dict:
    """The run ``chatlearn_train(args, out, tiny_model_dir, **variables)`` makes, in this process on the session's
    Ray and Prefect API (use with the ``ray_session`` and ``prefect_api`` fixtures): no interpreter, imports or Ray
    to start and stop (15 to 20 s a run here). For the runs whose point is not the command's own process. ``args``:
    a config first (a name or a path; none: the embedded default), then overrides. Returns the flow's result;
    a failing run raises."""
    from flows import train_flow

    config, overrides = (args[0], args[1:]) if args and "=" not in args[0] else (None, args)
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("CHATLEARN_OUTPUT_DIR", str(out))
    monkeypatch.setenv("CHATLEARN_TINY_MODEL_DIR", tiny_model_dir)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    return train_flow(config_path=config, overrides=list(overrides))


def command_here(args: list[str], cwd, forget_under=None, **variables):
    """`chatlearn ARGS` in this process, for the answers the command gives before it starts anything (an
    interpreter and its imports would be most of their time): a ``subprocess.CompletedProcess`` as
    `chatlearn_train` returns, run in ``cwd`` with ``variables`` set. ``sys.path`` is restored after it, and the
    modules imported from ``forget_under`` (a user's project) are forgotten, as that process would end with them:
    other tests name their own modules alike. Not for runs: a run's end is its own process's (`train_here`)."""
    import contextlib
    import io
    import subprocess
    import sys

    from chatlearn.cli import main

    out, err = io.StringIO(), io.StringIO()
    path, modules = list(sys.path), set(sys.modules)
    with pytest.MonkeyPatch.context() as here, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        here.chdir(cwd)
        for name, value in variables.items():
            here.setenv(name, value)
        try:
            code = main(list(args))
        finally:
            sys.path[:] = path
            for name in (set(sys.modules) - modules) if forget_under else ():
                if str(getattr(sys.modules[name], "__file__", None) or "").startswith(str(forget_under)):
                    del sys.modules[name]
    return subprocess.CompletedProcess(["chatlearn", *args], code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="session")
def prefect_api():
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    from chatlearn.runtime.records.prefect_server import SERVER_TUNING

    for key, value in SERVER_TUNING.items():  # the harness's server too, as `chatlearn train` starts its own
        os.environ.setdefault(key, value)
    with prefect_test_harness(server_startup_timeout=120), temporary_settings(
        {PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}
    ):
        yield


@pytest.fixture(scope="session")
def ray_session():
    import ray

    # fake GPUs are fine for scheduling checks; no test puts tensors on them
    # address="local": never the leftover address of a `ray start` cluster (tests/test_dlc.py starts one)
    ray.init(address="local", num_cpus=8, num_gpus=2, include_dashboard=False, namespace="chatlearn-tests",
             log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The default config's tiny Llama, built once per session."""
    from chatlearn.models.hf.tiny import ensure_tiny_model

    return str(ensure_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama"))


def build_tiny(tmp_path_factory, name: str) -> str:
    """configs/tiny_<name>.yaml's tiny model, built under the session's temporary folder; a `chatlearn train`
    with ``models.X.model_config_file=tiny_<name>.yaml`` finds it through ``CHATLEARN_TINY_<NAME>_DIR``."""
    import yaml

    from chatlearn.models.hf.tiny import ensure_tiny_model

    with open(os.path.join(REPO, "configs", f"tiny_{name}.yaml")) as f:
        spec = yaml.safe_load(f)["tiny_model"]
    return str(ensure_tiny_model(tmp_path_factory.mktemp("models") / f"tiny-{name}", spec))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory):
    """configs/tiny_qwen2.yaml's tiny Qwen2 (tied embeddings, 4 heads over 2 KV heads), built once per session
    (``CHATLEARN_TINY_QWEN2_DIR``)."""
    return build_tiny(tmp_path_factory, "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    """configs/tiny_qwen3.yaml's tiny Qwen3 (q/k norms, head_dim 128 over hidden 256, tied embeddings, 4 heads
    over 2 KV heads), built once per session (``CHATLEARN_TINY_QWEN3_DIR``)."""
    return build_tiny(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory):
    """configs/tiny_mistral.yaml's tiny Mistral (8 heads over 2 KV heads, an 8-token sliding window), built once
    per session (``CHATLEARN_TINY_MISTRAL_DIR``)."""
    return build_tiny(tmp_path_factory, "mistral")


@pytest.fixture(scope="session")
def shared_reference():
    """`../shared/reference` next to the repository (CI has it there too). Missing is a failure, never a skip."""
    path = os.path.join(os.path.dirname(REPO), "shared", "reference")
    assert os.path.isdir(path), f"the shared reference folder is missing: expected it at {path}"
    return path


@pytest.fixture(scope="session")
def reference_configs(shared_reference):
    """ChatLearn 1.0.2's own YAML configs, in `../shared/reference/chatlearn-1.0.2-configs`."""
    from pathlib import Path

    path = Path(shared_reference) / "chatlearn-1.0.2-configs"
    assert path.is_dir(), f"ChatLearn's reference configs are missing: expected them at {path}"
    return path


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on loopback (SQLite store), for the experiment tracker tests; its URI. The server runs
    from its own environment (`make setup` makes it): the runs' environment has mlflow's client only."""
    import socket
    import subprocess
    import sys
    import time
    import urllib.request
    from pathlib import Path

    server_python = Path(sys.prefix) / "mlflow-server" / "bin" / "python"
    if not server_python.exists():
        raise RuntimeError(f"the mlflow tracking server's environment is missing: expected {server_python} "
                           "(`make setup` creates it)")
    home = tmp_path_factory.mktemp("mlflow")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(home / "server.log", "w")  # noqa: SIM115 - open while the server runs
    proc = subprocess.Popen([str(server_python), "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--backend-store-uri", f"sqlite:///{home}/mlflow.db", "--default-artifact-root",
                             str(home / "artifacts"), "--workers", "1"], stdout=log, stderr=subprocess.STDOUT)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            urllib.request.urlopen(f"{uri}/health", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                log_text = (home / "server.log").read_text()[-2000:]
                raise RuntimeError(f"mlflow server did not start: {log_text}") from None
            time.sleep(0.2)
    yield uri
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


def machine_state() -> str:
    """Memory, disk, this process's open files and threads, and the machine's processes: what a failure on another
    machine (CI) needs beside its message."""
    import contextlib
    import shutil

    with open("/proc/meminfo") as f:
        meminfo = dict(line.split(":", 1) for line in f)
    available_mb = int(meminfo["MemAvailable"].split()[0]) // 1024
    free_mb = shutil.disk_usage(tempfile.gettempdir()).free // 2**20
    pids = [name for name in os.listdir("/proc") if name.isdigit()]
    threads = 0
    for pid in pids:  # a user's threads count against its process limit (ulimit -u), every process's together
        with contextlib.suppress(OSError):
            threads += len(os.listdir(f"/proc/{pid}/task"))
    return (f"memory available {available_mb} MB, {tempfile.gettempdir()} free {free_mb} MB, open files "
            f"{len(os.listdir('/proc/self/fd'))}, threads {len(os.listdir('/proc/self/task'))}; on the machine "
            f"{len(pids)} processes, {threads} threads")


class FailuresAsTheyHappen:
    """Each failure's last line (the first three in full) printed when it happens, with the machine's state: a CI
    run cut off at its time limit prints no summary, and a failure that is the machine's shows in its numbers."""

    SHOWN = 30

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.count = 0

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        terminal = self.config.pluginmanager.get_plugin("terminalreporter")  # registered after conftest's configure
        if not report.failed or terminal is None:
            return
        self.count += 1
        if self.count > self.SHOWN:
            return
        lines = report.longreprtext.strip().splitlines() or [""]
        terminal.write_line("")
        if self.count <= 3:
            for line in lines[-40:]:
                terminal.write_line(f"    {line}")
        message = [line for line in lines if line.startswith("E ")] or lines  # the exception's own lines
        terminal.write_line(f"FAILED ({report.when}) {report.nodeid}: {message[-1][:300]} [{machine_state()}]")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(FailuresAsTheyHappen(config), "failures-as-they-happen")
