"""Integration: the Prefect way of running chatlearn, against a real `prefect server` (started by `chatlearn
server`), a real process worker and headless Chromium.

One module-scoped server and worker; one train run through a deployment (the one that proves the form, the
overlap rule, the artifacts, the completion trigger and the browser pages), one through `chatlearn serve`.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC
from html import unescape
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.integration

FINAL = {"COMPLETED", "FAILED", "CANCELLED", "CRASHED"}
TINY = """includes: [{repo}/configs/default.yaml]
runtime:
  num_episode: 1
  sample_per_episode: 32
  generation_batch_size: 16
  train_micro_batch_size: 8
  train_global_batch_size: 16
  enable_eval_before_training: false
  output_dir: out
  exp_name: tiny
"""
BROWSER_OUT = Path(REPO) / "output" / "browser-tests"


def _popen(args: list[str], **kwargs) -> subprocess.Popen:
    """A child that handles Ctrl-C as from a terminal: a shell's background job (CI) starts with SIGINT ignored,
    which a child inherits, and then neither `chatlearn serve` nor `prefect worker` (SIGTERM -> SIGINT) stops."""
    return subprocess.Popen(args, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **kwargs)


def _stop(proc: subprocess.Popen, sig: int, grace: float = 60.0) -> None:
    """Stop a child with `sig`; SIGKILL after `grace` seconds (a test must never leave one behind)."""
    proc.send_signal(sig)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"{proc.args} did not stop on signal {sig} within {grace:.0f}s") from None


def _wait_for_line(proc_log: Path, prefix: str, timeout: float = 120.0) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        for line in proc_log.read_text().splitlines():
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        time.sleep(0.2)
    raise AssertionError(f"no line starting {prefix!r} in {proc_log}:\n{proc_log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    """`chatlearn server` on a fresh database, a process work pool and its worker; env for commands."""
    home = Path(tempfile.mkdtemp(prefix="chatlearn-deploy-"))
    # the worker and `chatlearn serve`'s runner ask for scheduled runs every 2 s, not Prefect's 10: what is tested
    # is what they run, and each of the module's runs waits up to that long to be picked up
    env = dict(os.environ, CHATLEARN_PREFECT_HOME=str(home / "server"), PREFECT_HOME=str(home / "cli"),
               CHATLEARN_TINY_MODEL_DIR=tiny_model_dir, PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_WORKER_QUERY_SECONDS="2", PREFECT_RUNNER_POLL_FREQUENCY="2")
    for key in ("PREFECT_API_URL", "RAY_ADDRESS"):
        env.pop(key, None)
    server_log = home / "server.out"
    server = _popen([sys.executable, "-m", "chatlearn.cli", "server"], env=env, cwd=home,
                    stdout=open(server_log, "w"), stderr=subprocess.STDOUT, text=True)
    worker = None
    try:
        url = _wait_for_line(server_log, "export PREFECT_API_URL=")
        ui = _wait_for_line(server_log, "Prefect UI (started local server):")  # the address a user opens
        assert url == f"{ui}/api"
        env["PREFECT_API_URL"] = url
        # the pool as the README creates it: no job variable lets a run choose what the worker executes
        subprocess.run([sys.executable, "-m", "prefect", "work-pool", "create", "chatlearn", "--type", "process",
                        "--overwrite", "--base-job-template", os.path.join(REPO, "deployments", "work-pool.json")],
                       env=env, check=True, capture_output=True, timeout=120)
        worker_log = home / "worker.out"
        worker = _popen([sys.executable, "-m", "prefect", "worker", "start", "--pool", "chatlearn"],
                        env=env, cwd=home, stdout=open(worker_log, "w"), stderr=subprocess.STDOUT)
        yield {"url": url, "ui": ui, "env": env, "home": home, "worker_log": worker_log,
               "server_log": server_log}
    finally:
        if worker is not None:
            _stop(worker, signal.SIGTERM)
        _stop(server, signal.SIGTERM)
        state = home / "server" / "server.json"
        assert not state.exists() or not json.loads(state.read_text()), "chatlearn server left its server running"


def _client(stack):
    from prefect.client.orchestration import SyncPrefectClient

    return SyncPrefectClient(stack["url"])


def _wait_final(stack, run_id, timeout: float = 420.0):
    deadline = time.time() + timeout
    with _client(stack) as client:
        while time.time() < deadline:
            run = client.read_flow_run(run_id)
            if run.state and run.state.type.value in FINAL:
                return run
            time.sleep(1.0)
    raise AssertionError(f"flow run {run_id} not finished in {timeout:.0f}s; worker log tail:\n"
                         + stack["worker_log"].read_text()[-4000:])


def _cli(stack, *args, cwd=REPO, timeout=300):
    res = subprocess.run([sys.executable, "-m", "chatlearn.cli", *args], env=stack["env"], cwd=cwd,
                         capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout + res.stderr
    return res


def chromium(url: str, png: Path) -> tuple[str, str]:
    """Open `url` in headless Chromium: a screenshot into `png`; the rendered page's text and its DOM."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, "Debian's chromium is needed for the browser tests (`.ci/run` installs it: apt-get install chromium)"
    flags = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--window-size=1400,1800", "--virtual-time-budget=25000"]
    png.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as profile:  # one page load for both (a load is seconds of CPU here)
        dom = subprocess.run([*flags, f"--user-data-dir={profile}", f"--screenshot={png}", "--dump-dom", url],
                             capture_output=True, text=True, timeout=120).stdout
    assert png.exists() and png.stat().st_size > 10_000, f"no screenshot of {url}"
    return unescape(re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))), dom


def test_deploy_form_overlap_trigger_artifacts_and_browser(stack, tmp_path):
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
    )
    from prefect.exceptions import PrefectHTTPStatusError

    # 1. prefect.yaml deploys as the README says (from the repository root)
    res = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all", "--prefect-file",
                          "deployments/prefect.yaml"], env=stack["env"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    with _client(stack) as client:
        yaml_train = client.read_deployment_by_name("chatlearn-train/default")
        yaml_eval = client.read_deployment_by_name("chatlearn-eval/eval-on-train-completion")
        assert yaml_train.parameters == {"config_path": "configs/default.yaml", "overrides": []}
        assert yaml_train.enforce_parameter_schema and yaml_train.work_pool_name == "chatlearn"
        assert [a.name for a in client.read_resource_related_automations(f"prefect.deployment.{yaml_eval.id}")]

    # 2. `chatlearn deploy`: the config is the form, with its schedule and an eval triggered on completion
    (tmp_path / "tiny.yaml").write_text(TINY.format(repo=REPO))
    # an alert every run meets (rewards are >= 0): its automation pauses the deployment after the first episode
    deployed = _cli(stack, "deploy", "tiny.yaml", "--cron", "0 3 * * *", "--name", "tiny", "--evaluate",
                    "--alert-on", "reward_mean > -1", cwd=tmp_path)
    out = deployed.stdout
    assert f"deployed chatlearn-train/tiny: {stack['ui']}/deployments/deployment/" in out
    assert "pinned: the engine, hooks, module classes and runtime_env" in out
    assert "warning: work pool" not in deployed.stderr  # the README's pool lets no run choose the command
    with _client(stack) as client:
        dep = client.read_deployment_by_name("chatlearn-train/tiny")
        eval_dep = client.read_deployment_by_name("chatlearn-eval/tiny-eval")
        assert [s.schedule.cron for s in dep.schedules] == ["0 3 * * *"]
        form = dep.parameters["config"]
        assert form["runtime"]["output_dir"] == str(tmp_path / "out" / "tiny")  # written where the config says
        assert form["runtime"]["alerts"] == ["reward_mean > -1"] and not dep.paused
        assert len(client.read_automations_by_name("chatlearn-train/tiny: pause when reward_mean > -1")) == 1
        schema = dep.parameter_openapi_schema
        num_episode = schema["definitions"]["RuntimeConfig"]["properties"]["num_episode"]
        assert num_episode["description"].startswith("[required] number of episodes")

        # 3. the server refuses a bad value before any run exists, naming our field path
        bad = json.loads(json.dumps(form))
        bad["runtime"]["num_episode"] = "three"
        with pytest.raises(PrefectHTTPStatusError) as refused:
            client.create_flow_run_from_deployment(dep.id, parameters={"config": bad})
        assert "config.runtime.num_episode" in str(refused.value)

        # 3b. the code is pinned: the server refuses a changed hook, an override of one, a command of a run's own
        (tmp_path / "pin_marker.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n\n"
                                                "def fn(sample):\n    return 0.0\n")
        hooked = json.loads(json.dumps(form))
        hooked["models"]["reward"]["args_dict"]["reward_fn"] = "pin_marker:fn"
        with pytest.raises(PrefectHTTPStatusError) as refused:
            client.create_flow_run_from_deployment(dep.id, parameters={"config": hooked})
        assert "config.models.reward.args_dict.reward_fn" in str(refused.value)
        with pytest.raises(PrefectHTTPStatusError) as refused:
            client.create_flow_run_from_deployment(dep.id, parameters={
                "config": form, "overrides": ["runtime.relay_sample_fn=pin_marker:fn"]})
        assert "overrides[0]" in str(refused.value)
        with pytest.raises(PrefectHTTPStatusError) as refused:
            client.create_flow_run_from_deployment(dep.id, parameters={"config": form},
                                                   job_variables={"command": f"touch {tmp_path / 'ran'}"})
        assert "command" in str(refused.value)
        # a client may ask the server to skip the schema: the flow refuses the changed hook before importing it
        skipped = client.request("POST", "/deployments/{id}/create_flow_run", path_params={"id": dep.id}, json={
            "parameters": {"config": hooked}, "enforce_parameter_schema": False, "state": {"type": "SCHEDULED"}})
        skipped_id = skipped.json()["id"]
    failed = _wait_final(stack, skipped_id)
    assert failed.state.type.value == "FAILED", failed.state.message
    assert "models.reward.args_dict.reward_fn: 'pin_marker:fn' differs from " \
           "'chatlearn.tasks.max_digit:max_digit_reward', pinned when chatlearn-train/tiny was deployed" \
        in failed.state.message, failed.state.message
    assert not (tmp_path / "imported").exists() and not (tmp_path / "ran").exists()
    with _client(stack) as client:
        # 4. a run from the form (one field changed) and, at once, a second: the overlap rule skips it
        form["runtime"]["exp_name"] = "from-form"
        first = client.create_flow_run_from_deployment(dep.id, parameters={"config": form})
        second = client.create_flow_run_from_deployment(dep.id, parameters={"config": form})
    runs = [_wait_final(stack, first.id), _wait_final(stack, second.id)]
    states = sorted(r.state.type.value for r in runs)
    assert states == ["CANCELLED", "COMPLETED"], [(r.state.type.value, r.state.message) for r in runs]
    done = next(r for r in runs if r.state.type.value == "COMPLETED")
    # the run said its alert (the Prefect event chatlearn.alert): the automation paused the deployment
    deadline = time.time() + 60
    with _client(stack) as client:
        while not client.read_deployment(dep.id).paused and time.time() < deadline:
            time.sleep(0.5)
        assert client.read_deployment(dep.id).paused
    # each run of a deployment writes its own run directory inside the config's (output_dir/exp_name):
    # <deployment>-<scheduled time, UTC> (deployment.runs: separate, the default)
    stamp = done.expected_start_time.astimezone(UTC).strftime("%Y%m%d-%H%M%S")
    run_dir = tmp_path / "out" / "tiny" / "from-form" / f"tiny-{stamp}"
    assert [p.name for p in run_dir.parent.iterdir()] == [run_dir.name]
    assert (run_dir / "final" / "policy" / "config.json").exists()
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1
    exp = run_dir.name  # the run's exp_name: its artifacts are its own

    with _client(stack) as client:
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
            any_=[done.id])))
        keys = {a.key for a in arts}
        assert {f"{exp}-outputs", f"{exp}-metrics", f"{exp}-progress", f"{exp}-curves"} <= keys, keys
        # the episode's page holds its samples that explain it; the run's outputs name the whole tables
        (episode,) = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[done.id])))
        samples = [a for a in client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[episode.id]))) if a.key == f"{exp}-samples"]
        assert len(samples) == 1 and samples[0].flow_run_id == episode.id
        outputs = {row["output"]: row["path"] for row in json.loads(
            next(a for a in arts if a.key == f"{exp}-outputs").data)}
        assert outputs["traces"] == str(run_dir / "traces")

    # 5. the completion trigger started the eval deployment on that run: its final policy, into its run dir
    deadline = time.time() + 120
    while time.time() < deadline:
        with _client(stack) as client:
            evals = client.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(
                any_=[eval_dep.id, yaml_eval.id])), flow_run_filter=FlowRunFilter())
        if evals:
            break
        time.sleep(1.0)
    assert len(evals) == 1 and evals[0].deployment_id == eval_dep.id, evals  # prefect.yaml's: not for this one
    assert evals[0].parameters["train_run"] == f"prefect.flow-run.{done.id}"
    final = _wait_final(stack, evals[0].id)
    assert final.state.type.value == "COMPLETED", final.state.message
    evaluated = json.loads((run_dir / "eval" / "eval.json").read_text())
    assert evaluated["model_path"] == str(run_dir / "final" / "policy")
    assert "eval_reward_mean" in evaluated

    # 6. what a user sees: the run form with the config's fields; the finished run's metrics table and curve
    form_text, _ = chromium(f"{stack['ui']}/deployments/deployment/{dep.id}/run", BROWSER_OUT / "run-form.png")
    assert "Can't connect" not in form_text
    for field in ("Num Episode", "[required] number of episodes", "Sample Per Episode", "Runtime Env"):
        assert field in form_text, field
    by_key = {a.key: a for a in arts}
    table_text, _ = chromium(f"{stack['ui']}/artifacts/artifact/{by_key[f'{exp}-metrics'].id}",
                             BROWSER_OUT / "run-metrics.png")
    assert f"per-episode metrics of {exp}" in table_text
    for column in ("episode", "reward_mean", "kl_mean", "episode_seconds"):
        assert column in table_text, column
    assert by_key[f"{exp}-metrics"].flow_run_id == done.id
    curve_text, curve_dom = chromium(f"{stack['ui']}/artifacts/artifact/{by_key[f'{exp}-curves'].id}",
                                     BROWSER_OUT / "run-curves.png")
    assert "reward / KL / eval curve" in curve_text and 'src="data:image/png;base64,' in curve_dom
    samples_text, _ = chromium(f"{stack['ui']}/artifacts/artifact/{samples[0].id}", BROWSER_OUT / "samples.png")
    for shown in ("highest advantage", "lowest advantage", "at random", "policy_version",
                  f"chatlearn trace {run_dir} --episode 1"):
        assert shown in samples_text, shown


def test_serve_runs_a_deployment_from_one_process(stack, tmp_path):
    (tmp_path / "tiny.yaml").write_text(TINY.format(repo=REPO))
    log = tmp_path / "serve.out"
    # deployment.runs: continue: every run of the deployment continues the one run in output_dir/exp_name
    serve = _popen([sys.executable, "-m", "chatlearn.cli", "serve", "tiny.yaml", "--name", "served",
                    "--on-overlap", "queue", "runtime.exp_name=served", "deployment.runs=continue"], env=stack["env"],
                   cwd=tmp_path,
                   stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        dep = None
        with _client(stack) as client:
            while dep is None and time.time() < deadline:
                try:
                    dep = client.read_deployment_by_name("chatlearn-train/served")
                except Exception:
                    time.sleep(0.5)
            assert dep is not None, log.read_text()
            assert dep.concurrency_options.collision_strategy.value == "ENQUEUE"
            time.sleep(2)  # the runner polls for its deployments' runs once it is up
            run = client.create_flow_run_from_deployment(dep.id)
        finished = _wait_final(stack, run.id)
        assert finished.state.type.value == "COMPLETED", log.read_text()[-4000:]
        assert (tmp_path / "out" / "served" / "metrics.jsonl").exists()
    finally:
        _stop(serve, signal.SIGINT)  # Ctrl-C, as a user stops it


def test_an_engine_of_ones_own_from_the_command_and_its_run_graph(stack, tmp_path):
    """`chatlearn train examples/custom_engine.yaml`: a user's Engine (examples/custom_engine.py, named by
    runtime.engine) with two rule rewards combined by weight and a filter step. One episode and its eval: the
    trained reward is the weighted sum of the two, logged by name; every call of its flows is a task run with the
    calls it reads as its inputs, and the UI shows the episode's run graph (a screenshot for the README)."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterName

    _cli(stack, "train", "examples/custom_engine.yaml", "runtime.num_episode=1", "runtime.sample_per_episode=32",
         "runtime.generation_batch_size=32", "runtime.train_micro_batch_size=16",
         "runtime.train_global_batch_size=32", "runtime.eval_episode_interval=1",
         "runtime.enable_eval_before_training=false", f"runtime.output_dir={tmp_path}", timeout=600)
    (row,) = [json.loads(line) for line in (tmp_path / "custom_engine" / "metrics.jsonl").read_text().splitlines()]
    # reward_weights {answer: 1.0, format: 0.5}: the trained score is the weighted sum, each reward logged
    assert row["reward_mean"] == pytest.approx(row["rewards/answer_mean"] + 0.5 * row["rewards/format_mean"],
                                               abs=1e-6)
    # the filter keeps whole prompt groups of 8 (those whose scores differ)
    assert row["num_samples"] % 8 == 0 and 0 < row["num_samples"] <= 32 and "eval_reward_mean" in row
    with _client(stack) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=["episode-1"])))
        # an episode's ctx parameter shows the run's spec (chatlearn.runtime.context.RunContext.as_parameter)
        episode = next(r for r in runs
                       if r.parameters.get("ctx", {}).get("runtime", {}).get("exp_name") == "custom_engine")
        expected = {"policy.forward_step", "reference.forward_step", "format.score_step", "answer.forward_step",
                    "drop_uniform_groups", "ppo_policy.train_step", "policy.eval_forward", "answer.eval_forward"}
        deadline = time.monotonic() + 30  # the server writes task runs in batches, after the process is gone
        while True:
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[episode.id])))
            by_name = {t.name: t for t in tasks}
            if expected <= set(by_name) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert expected <= set(by_name)
    assert {i.id for i in by_name["drop_uniform_groups"].task_inputs["upstream"]} == {by_name["answer.forward_step"].id}
    assert {i.id for i in by_name["answer.forward_step"].task_inputs["upstream"]} == {
        by_name["reference.forward_step"].id, by_name["format.score_step"].id}
    text, _ = chromium(f"{stack['ui']}/runs/flow-run/{episode.id}", BROWSER_OUT / "custom-engine-graph.png")
    assert "episode-1" in text
