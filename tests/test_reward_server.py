"""A reward model as a service: `chatlearn reward-server` (a real process on loopback, serving a tiny reward model
built here) and `ModelReward` with ``args_dict.remote_url``: the same scores as in-process, retries through a
server that went away or is slow, one line naming the URL when it stays down."""

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from chatlearn.cli import main
from chatlearn.config import ConfigError, EngineChecks, load_config
from chatlearn.models.hf.remote_reward import RemoteReward
from chatlearn.models.hf.reward import ModelReward, ModelRewardArgs
from chatlearn.utils.arguments import ModelConfig, RuntimeConfig
from chatlearn.utils.errors import RunError
from tests.conftest import REPO

CLI = [sys.executable, "-m", "chatlearn.cli"]
SERVER_BATCH = 4  # the server's --batch-size
# prompt+response pairs of different lengths (left padding differs per batch): more than the server's batch and
# the client's requests (remote_batch_size 5) hold, none a multiple of them
PROMPTS = [f"max {' '.join(str((i * 7 + j) % 10) for j in range(1 + i % 9))} ?" for i in range(23)]
RESPONSES = [str(i % 10) * (1 + i % 3) for i in range(23)]


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    """A tiny Llama reward model (sequence classification, one label) with the project's character tokenizer."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from chatlearn.models.hf.tiny import build_char_tokenizer

    path = tmp_path_factory.mktemp("models") / "tiny-reward"
    tok = build_char_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_labels=1,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


class Server:
    """A `chatlearn reward-server` process; ``start`` reads the URL it prints first."""

    def __init__(self, model: str, logs: str) -> None:
        self.model, self.logs = model, logs
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.port = 0
        self._lines: queue.Queue = queue.Queue()
        self.starts = 0

    def launch(self, port: int = 0) -> None:
        """Start the process; `wait_ready` reads its address."""
        self.starts += 1
        self.stderr = os.path.join(self.logs, f"server-{self.starts}.err")
        self.proc = subprocess.Popen(
            [*CLI, "reward-server", self.model, "--port", str(port), "--batch-size", str(SERVER_BATCH)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=open(self.stderr, "w"), text=True,
            env=dict(os.environ, OMP_NUM_THREADS="1"))
        self._lines = queue.Queue()
        threading.Thread(target=lambda out, q: [q.put(line) for line in out], args=(self.proc.stdout, self._lines),
                         daemon=True).start()

    def wait_ready(self, timeout: float = 90.0) -> str:
        try:
            first = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no address from the server in {timeout}s; stderr: {self.read_stderr()}") from None
        prefix = f"chatlearn reward-server: serving {self.model} on "
        assert first.startswith(prefix), (first, self.read_stderr())
        self.url = first[len(prefix):].strip()
        self.port = int(self.url.rsplit(":", 1)[1])
        return self.url

    def read_stderr(self) -> str:
        with open(self.stderr) as f:
            return f.read()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(reward_model, tmp_path_factory):
    """One real server for the module (its start-up imports torch and transformers: seconds)."""
    srv = Server(reward_model, str(tmp_path_factory.mktemp("server-logs")))
    srv.launch()
    srv.wait_ready()
    yield srv
    srv.stop()


def bound(args: dict) -> ModelReward:
    mod = ModelReward("reward")
    mod.bind(ModelConfig(num_cpu=1, args_dict=args), RuntimeConfig(), 0, seed=7)
    mod.setup()
    return mod


def batch(n: int = len(PROMPTS)) -> dict:
    return {"prompt": PROMPTS[:n], "response": RESPONSES[:n], "sample_id": list(range(n))}


def post(url: str, body: bytes, path: str = "/score") -> tuple[int, dict]:
    request = urllib.request.Request(url + path, data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_remote_scores_equal_the_in_process_reward_models(server, reward_model):
    local = bound({"model_path": reward_model})
    remote = bound({"remote_url": server.url, "remote_batch_size": 5})
    assert remote.model is None and remote.num_parameters() == 0  # no model in this process
    data = batch()
    expected = local.eval_step(data)["scores"]
    got = remote.eval_step(data)["scores"]
    assert got.shape == (len(PROMPTS),) and got.dtype == torch.float32
    assert expected.std() > 0.01  # the comparison means something: texts score differently
    assert torch.allclose(got, expected, atol=1e-6, rtol=0), (got - expected).abs().max()
    # the server's prompts+responses form joins them as ModelReward does, and /health names the model
    status, body = post(server.url, json.dumps({"prompts": PROMPTS[:3], "responses": RESPONSES[:3]}).encode())
    assert status == 200 and torch.allclose(torch.tensor(body["scores"]), expected[:3], atol=1e-6, rtol=0)
    with urllib.request.urlopen(server.url + "/health", timeout=30) as response:
        assert json.loads(response.read()) == {"status": "ok", "model": reward_model, "batch_size": SERVER_BATCH}


def test_a_rule_and_a_served_model_reward_combine_by_weight_each_kept_by_name(server):
    """GRPOMath / an engine of one's own: the rule reward's inputs hold the served model reward's scores (its
    score_step, over HTTP); it trains on 1.0 * its own + 0.25 * the model's, as group advantages, and keeps each
    reward's scores under its name (the episode logs rewards/<name>_mean)."""
    from chatlearn.algorithms.grpo import group_advantages_by_id
    from chatlearn.models.hf.reward import RuleReward

    rm = ModelReward("rm")
    rm.bind(ModelConfig(num_cpu=1, args_dict={"remote_url": server.url}), RuntimeConfig(), 0, seed=7)
    rm.setup()
    rule = RuleReward("reward")
    rule.bind(ModelConfig(num_cpu=1, args_dict={"reward_fn": "chatlearn.tasks.max_digit:max_digit_reward",
                                                "advantage_estimator": "grpo", "reward_weights": {"rm": 0.25}}),
              RuntimeConfig(engine="grpo_math"), 0, seed=7)
    rule.setup()
    data = {**batch(8), "answer": [str(max(int(c) for c in p if c.isdigit())) for p in PROMPTS[:8]],
            "group_id": [0, 0, 0, 0, 1, 1, 1, 1]}
    model_scores = rm.score_step(data)["rewards/rm"]
    out = rule.forward_step({**data, "rewards/rm": model_scores}, 0)
    own = out["rewards/reward"]
    assert torch.allclose(out["scores"], own + 0.25 * model_scores, atol=1e-6)
    assert model_scores.std() > 0 and not torch.equal(out["scores"], own)
    expected = group_advantages_by_id(own + 0.25 * model_scores, data["group_id"])
    assert torch.allclose(out["advantages"], expected, atol=1e-5)


def test_a_malformed_request_gets_a_400_and_the_server_keeps_serving(server):
    cases = [
        (b"not json", "the body is not JSON"),
        (b"[1, 2]", "the body must be a JSON object"),
        (b'{"text": ["a"]}', "no texts"),
        (b'{"texts": ["a", 3]}', "texts[1] must be a string, got int"),
        (b'{"prompts": ["a", "b"], "responses": ["c"]}', "2 prompts but 1 responses"),
        (b'{"texts": ["a"], "prompts": ["a"], "responses": ["b"]}', "not both"),
    ]
    for body, message in cases:
        status, answer = post(server.url, body)
        assert status == 400 and message in answer["error"], (body, status, answer)
    assert post(server.url, b"{}", path="/nowhere")[0] == 404
    status, answer = post(server.url, json.dumps({"texts": ["max 1 2 ?2"]}).encode())
    assert status == 200 and len(answer["scores"]) == 1
    assert server.proc.poll() is None


def test_no_server_at_setup_is_one_line_naming_the_url_and_the_command_that_starts_one():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    begun = time.monotonic()
    with pytest.raises(RunError) as err:
        bound({"remote_url": url, "remote_retries": 2, "remote_backoff_s": 0.05, "remote_timeout_s": 2})
    assert time.monotonic() - begun < 5
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"reward: no reward server answers at {url} (connection refused; 3 tries in ")
    assert f"start one there with `chatlearn reward-server MODEL_PATH --port {port}`" in message
    assert "models.reward.args_dict.remote_url" in message


class Stub:
    """A stand-in server in a thread of this process: ``answer(n)`` says what its n-th request (from 1) gets:
    (seconds to wait, HTTP status, JSON body), or None to close the connection without an answer."""

    def __init__(self, answer) -> None:
        self.requests = 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                self._answer()

            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self._answer()

            def _answer(self):
                stub.requests += 1
                planned = answer(stub.requests)
                if planned is None:
                    self.close_connection = True
                    return
                wait, status, body = planned
                time.sleep(wait)
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the client gave up waiting

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.http.shutdown()
        self.http.server_close()


def client(url: str, **kwargs) -> RemoteReward:
    return RemoteReward(url, **{"batch_size": 8, "timeout_s": 0.3, "retries": 1, "backoff_s": 0.0, **kwargs})


def test_a_slow_server_makes_the_client_time_out_and_retry_not_hang():
    with Stub(lambda n: (2.0, 200, {"scores": [0.5]})) as stub:
        begun = time.monotonic()
        with pytest.raises(RunError) as err:
            client(stub.url).score(["a"])
        took = time.monotonic() - begun
        assert took < 1.5  # two tries of 0.3 s, not the stub's 2 s each
        assert stub.requests == 2
        port = stub.url.rsplit(":")[-1]
        assert re.fullmatch(rf"reward: the reward server at {stub.url} did not score a batch of 1 texts \(no answer "
                            rf"within remote_timeout_s=0.3s; 2 tries in 0\.\ds\); is it still running\? "
                            rf"\(`chatlearn reward-server MODEL_PATH --port {port}`\)", str(err.value)), str(err.value)
    # slow once, then answering: the retry gets the scores
    with Stub(lambda n: (2.0 if n == 1 else 0.0, 200, {"scores": [0.25, 0.5]})) as stub:
        assert client(stub.url).score(["a", "b"]) == [0.25, 0.5]
        assert stub.requests == 2


def test_a_5xx_or_a_dropped_connection_is_retried_a_4xx_is_not():
    with Stub(lambda n: (0, 503, {"error": "busy"}) if n == 1 else None if n == 2 else (0, 200, {"scores": [1]})) \
            as stub:
        assert client(stub.url, retries=2).score(["a"]) == [1.0]
        assert stub.requests == 3
    with Stub(lambda n: (0, 400, {"error": "texts[0] must be a string, got int"})) as stub:
        with pytest.raises(RunError, match=r"^reward: the reward server at .* refused /score: HTTP 400: texts\[0\] "
                                           r"must be a string, got int$"):
            client(stub.url, retries=3).score(["a"])
        assert stub.requests == 1


def test_a_wrong_answer_is_a_run_error_naming_the_url():
    with Stub(lambda n: (0, 200, {"scores": [0.1] * 8 if n == 1 else [0.1]})) as stub:
        # 9 texts in requests of 8 and 1: each answer as long as its request
        assert client(stub.url).score(["x"] * 9) == [0.1] * 9
    with Stub(lambda n: (0, 200, {"scores": [0.1, 0.2]})) as stub:
        with pytest.raises(RunError, match=rf"^reward: the reward server at {stub.url} returned 2 scores for 1 "
                                           "texts$"):
            client(stub.url).score(["x"])
    with Stub(lambda n: (0, 200, {"status": "ok"} if n == 1 else {"scores": [float("nan"), 1.0]})) as stub:
        mod = bound({"remote_url": stub.url})
        with pytest.raises(RunError) as err:
            mod.score(batch(2))
        assert str(err.value) == (f"reward: non-finite score from the reward server at {stub.url} (nan) for "
                                  f"sample_id 0 (prompt \"{PROMPTS[0]}\")")


@pytest.mark.slow
def test_a_server_killed_mid_run_is_a_run_error_and_one_restarted_on_the_same_port_is_retried(server):
    url, port = server.url, server.port
    data = batch()
    before = bound({"remote_url": url, "remote_batch_size": 8}).score(data)
    # killed between two batches of the run: retried within the budget, then one line naming the URL
    mod = bound({"remote_url": url, "remote_retries": 2, "remote_backoff_s": 0.1, "remote_timeout_s": 2})
    patient = bound({"remote_url": url, "remote_retries": 8, "remote_backoff_s": 0.25, "remote_timeout_s": 30})
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(timeout=30)
    begun = time.monotonic()
    with pytest.raises(RunError) as err:
        mod.score(data)
    assert time.monotonic() - begun < 3 * 2 + 0.1 + 0.2 + 1  # (retries + 1) timeouts and the waits, at most
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"reward: the reward server at {url} did not score a batch of 23 texts (connection "
                              "refused; 3 tries in ")
    assert message.endswith(f"is it still running? (`chatlearn reward-server MODEL_PATH --port {port}`)")
    # started again on the same port between two batches: the batch sent while it loads is retried, and scored
    server.proc = None
    server.launch(port)
    after = patient.score(data)
    assert server.wait_ready(timeout=5) == url
    assert torch.allclose(after, before, atol=1e-6, rtol=0)


def test_remote_fields_are_checked_with_the_config(reward_model, tmp_path):
    def checked(args: dict):
        override = "models.reward.args_dict=" + json.dumps({"module": "chatlearn.models.hf.reward:ModelReward",
                                                            **args})
        return load_config(os.path.join(REPO, "configs", "default.yaml"), [override], [EngineChecks()])

    def problems(args: dict) -> list[str]:
        with pytest.raises(ConfigError) as err:
            checked(args)
        return err.value.problems

    checked({"remote_url": "http://127.0.0.1:8765", "remote_batch_size": 64, "remote_retries": 0})  # no model_path

    assert problems({"remote_url": "http://127.0.0.1:8765", "model_path": reward_model, "dtype": "bfloat16"}) == [
        f"models.reward.args_dict.remote_url: the reward model is served at http://127.0.0.1:8765, so "
        f"model_path={reward_model!r}, dtype='bfloat16' would load nothing here: give them to `chatlearn "
        "reward-server` (MODEL_PATH, --dtype) and remove them, or remove remote_url to load the model in this process"]
    assert problems({"model_path": reward_model, "remote_retries": 5}) == [
        "models.reward.args_dict.remote_retries: remote_retries sets how the reward server is called, and there is "
        "none: set remote_url too, or remove it"]
    assert problems({"remote_url": "127.0.0.1:8765"}) == [
        "models.reward.args_dict.remote_url: '127.0.0.1:8765' is not an http(s) URL with a host, e.g. "
        "http://127.0.0.1:8765"]
    assert problems({"remote_url": "http://127.0.0.1:8765", "remote_timeout_s": 0})[0].startswith(
        "models.reward.args_dict.remote_timeout_s: Input should be greater than 0")
    # remote: no model files to check or build here; neither given: the message names both ways
    remote = ModelConfig(args_dict={"remote_url": "http://127.0.0.1:8765"})
    assert ModelReward("reward").check_files(remote) == []
    assert ModelReward("reward").check_files(ModelConfig(args_dict={})) == [
        "args_dict.model_path: required: the local Hugging Face model directory ModelReward loads (or "
        "args_dict.remote_url: a reward server's URL, `chatlearn reward-server`)"]
    assert ModelRewardArgs.model_validate({"remote_url": "http://h:1/"}).remote_backoff_s == 1.0


def test_the_command_documents_its_options_and_refuses_a_missing_model_in_one_line(capsys, tmp_path):
    from chatlearn.cli import _parser

    with pytest.raises(SystemExit) as done:
        main(["reward-server", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "example:\n  chatlearn reward-server" in text
    sub = _parser()._subparsers._group_actions[0].choices["reward-server"]
    for action in sub._actions:
        for flag in action.option_strings:
            assert flag in text
        if action.dest != "help":
            assert action.help, f"reward-server {action.option_strings or action.dest} has no help"
    missing = tmp_path / "nope"
    assert main(["reward-server", str(missing), "--port", "0"]) == 1
    assert capsys.readouterr().err == (f"chatlearn: error: reward-server: MODEL_PATH {str(missing)!r} is not a "
                                       "directory (a local Hugging Face model directory of a sequence-classification "
                                       "reward model)\n")


def test_sigterm_stops_the_server_cleanly(server):
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=30) == 0
    assert server.read_stderr().rstrip().endswith("chatlearn reward-server: stopped by SIGTERM")
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url + "/health", timeout=5)


def test_the_preflight_checks_no_model_files_for_a_remote_reward(tiny_model_dir, monkeypatch, tmp_path):
    """Before anything starts, a remote reward needs no model_path: the server holds the model."""
    from chatlearn.data.preflight import preflight
    from chatlearn.runtime.engines import resolve_engine  # torch-heavy: only here

    monkeypatch.setenv("CHATLEARN_TINY_MODEL_DIR", tiny_model_dir)
    args = {"module": "chatlearn.models.hf.reward:ModelReward", "remote_url": "http://127.0.0.1:8765"}
    cfg = load_config(os.path.join(REPO, "configs", "default.yaml"),
                      [f"runtime.output_dir={tmp_path / 'out'}", "models.reward.args_dict=" + json.dumps(args)],
                      [EngineChecks()])
    assert preflight(cfg, resolve_engine(cfg, None, None)).prompts
