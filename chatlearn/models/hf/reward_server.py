"""A reward model as a service: `chatlearn reward-server MODEL_PATH [--port P]`.

One process loads the reward model once (`ModelReward.load`: the tokenizer and an
``AutoModelForSequenceClassification`` with one label, as the in-process reward does) and serves it over HTTP
to every run that names it in ``models.<name>.args_dict.remote_url`` (the client is
:mod:`chatlearn.models.hf.remote_reward`). Standard library only (``http.server``), JSON bodies:

* ``GET /health`` -> ``{"status": "ok", "model": MODEL_PATH, "batch_size": N}``
* ``POST /score`` with ``{"texts": [...]}``, or ``{"prompts": [...], "responses": [...]}`` (each pair joined as
  ``prompt + response``, as `ModelReward` joins them) -> ``{"scores": [...]}``, one float per text, in order.

Texts are scored in batches of ``--batch-size`` by `ModelReward.score_texts`, the in-process reward's own
scoring (same tokenizer call, left padding, no truncation), so a remote score is the local one. Connections are
served in threads; the model runs under one lock. A request the server cannot read (not JSON, no texts, a text
that is not a string, prompts and responses of different lengths) is a 400 with ``{"error": "..."}`` and the
server keeps serving; a failure while scoring is a 500 with its message (the client retries those). The
server binds the port once the model is loaded and then prints ``chatlearn reward-server: serving MODEL_PATH on
http://HOST:PORT`` as its first line on stdout (``--port 0``: a free port; that line says which). SIGTERM or
Ctrl-C stops it: it takes no more requests, closes the port and exits 0 (a request cut off on the way is
retried by the client, against this server started again or another on the same URL).

There is no authentication: the default address is the loopback one; another (``--host 0.0.0.0``, for a
cluster) opens it to every machine that reaches this one, which is said on stderr.
"""

import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from chatlearn.models.hf.reward import ModelReward
from chatlearn.utils.errors import RunError

DEFAULT_PORT = 8765
DEFAULT_BATCH_SIZE = 16
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# the largest request body read (about a million texts of 64 characters): a bigger one is a 413, not memory
MAX_BODY_BYTES = 64 * 2**20


class BadRequest(ValueError):
    """A request the server cannot read: a 400 (or ``status``) with this message."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.status = status


class RewardScorer:
    """The reward model of ``path``, loaded once, scoring texts in batches of ``batch_size`` under a lock."""

    def __init__(self, path: str, dtype: str = "float32", batch_size: int = DEFAULT_BATCH_SIZE,
                 device: str | None = None) -> None:
        if batch_size < 1:
            raise RunError(f"reward-server: --batch-size must be at least 1, got {batch_size}")
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise RunError(f"reward-server: --dtype {dtype!r} is not a torch dtype (float32, bfloat16, float16)")
        if not os.path.isdir(path):
            raise RunError(f"reward-server: MODEL_PATH {path!r} is not a directory (a local Hugging Face model "
                           "directory of a sequence-classification reward model)")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise RunError(f"reward-server: MODEL_PATH {path!r} has no config.json: not a Hugging Face model "
                           "directory")
        self.path = path
        self.batch_size = batch_size
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.tokenizer, self.model = ModelReward.load(path, dtype, self.device)
        self.lock = threading.Lock()

    def score(self, texts: Sequence[str]) -> list[float]:
        out: list[float] = []
        with self.lock:  # one model, many connections
            for start in range(0, len(texts), self.batch_size):
                chunk = list(texts[start:start + self.batch_size])
                out += ModelReward.score_texts(self.model, self.tokenizer, chunk, self.device).tolist()
        return out


def request_texts(body: Any) -> list[str]:
    """The texts of a ``/score`` body (see the module docstring); BadRequest saying what is wrong."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object: {\"texts\": [...]} or {\"prompts\": [...], "
                         "\"responses\": [...]}")
    if "texts" in body:
        texts = _strings(body["texts"], "texts")
        if "prompts" in body or "responses" in body:
            raise BadRequest("give either texts, or prompts and responses, not both")
        return texts
    if "prompts" in body and "responses" in body:
        prompts, responses = _strings(body["prompts"], "prompts"), _strings(body["responses"], "responses")
        if len(prompts) != len(responses):
            raise BadRequest(f"{len(prompts)} prompts but {len(responses)} responses")
        return [p + r for p, r in zip(prompts, responses, strict=True)]
    raise BadRequest(f"no texts: the body must hold \"texts\", or \"prompts\" and \"responses\" (it holds "
                     f"{sorted(body)})")


def _strings(value: Any, key: str) -> list[str]:
    if not isinstance(value, list):
        raise BadRequest(f"{key} must be a list of strings, got {type(value).__name__}")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise BadRequest(f"{key}[{i}] must be a string, got {type(item).__name__}")
    return value


class _Handler(BaseHTTPRequestHandler):
    server: "RewardServer"
    server_version = "chatlearn-reward-server"
    timeout = 300  # seconds a connection may sit without sending its request

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.rstrip("/") == "/health":
            scorer = self.server.scorer
            self._send(HTTPStatus.OK, {"status": "ok", "model": scorer.path, "batch_size": scorer.batch_size})
        else:
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint: GET {self.path} (GET /health, "
                                                       "POST /score)"})

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.rstrip("/") != "/score":
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint: POST {self.path} (POST /score)"})
            return
        try:
            texts = request_texts(self._body())
        except BadRequest as exc:
            self._send(exc.status, {"error": str(exc)})
            return
        try:
            scores = self.server.scorer.score(texts)
        except Exception as exc:  # noqa: BLE001 (a text the model cannot score: the client hears why)
            message = " ".join(str(exc).split()) or type(exc).__name__
            self.log_message("scoring %d texts failed: %s", len(texts), message)
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"scoring failed: {message}"})
            return
        self._send(HTTPStatus.OK, {"scores": scores})

    def _body(self) -> Any:
        length = self.headers.get("Content-Length")
        if length is None or not length.strip().isdigit():
            raise BadRequest("a POST needs a Content-Length header", HTTPStatus.LENGTH_REQUIRED)
        size = int(length)
        if size > MAX_BODY_BYTES:
            raise BadRequest(f"the body is {size} bytes, more than the {MAX_BODY_BYTES} one request may hold: send "
                             "fewer texts per request", HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
        raw = self.rfile.read(size)
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(f"the body is not JSON: {exc}") from None

    def _send(self, status: HTTPStatus, payload: dict) -> None:
        # non-finite scores go out as NaN / Infinity (Python's json reads them): the client names the sample
        data = json.dumps(payload, allow_nan=True).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass  # a line per request would drown the errors

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
        print(f"chatlearn reward-server: {self.address_string()}: {format % args}", file=sys.stderr, flush=True)


class RewardServer(ThreadingHTTPServer):
    """The HTTP server of one `RewardScorer` (a thread per connection)."""

    daemon_threads = True

    def __init__(self, scorer: RewardScorer, host: str = "127.0.0.1", port: int = DEFAULT_PORT) -> None:
        self.scorer = scorer
        try:
            super().__init__((host, port), _Handler)
        except OSError as exc:
            raise RunError(f"reward-server: cannot listen on {host}:{port}: {exc.strerror or exc} (another "
                           "server on that port? choose another with --port, or --port 0 for a free one)") from None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = f"[{host}]" if ":" in str(host) else host
        return f"http://{host}:{port}"


def serve(path: str, host: str = "127.0.0.1", port: int = DEFAULT_PORT, batch_size: int = DEFAULT_BATCH_SIZE,
          dtype: str = "float32", device: str | None = None,
          announce: Callable[[str], Any] = print) -> None:
    """Load the model, serve it until SIGTERM / SIGINT, then close the port (`chatlearn reward-server`).

    The first line ``announce`` gets (stdout by default) names the model and the bound URL."""
    stop = threading.Event()
    signame: list[str] = []

    def on_signal(signum: int, _frame: Any) -> None:
        signame.append(signal.Signals(signum).name)
        if not stop.is_set():
            stop.set()
            raise KeyboardInterrupt  # leaves the model's loading or the wait below at once

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    server: RewardServer | None = None
    thread: threading.Thread | None = None
    try:
        try:
            server = RewardServer(RewardScorer(path, dtype, batch_size, device), host, port)
            thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                      name="reward-server", daemon=True)
            thread.start()
            announce(f"chatlearn reward-server: serving {path} on {server.url}")
            sys.stdout.flush()
            if host not in LOOPBACK:
                print(f"chatlearn reward-server: warning: --host {host} serves the reward model without "
                      "authentication to every machine that reaches this one", file=sys.stderr, flush=True)
            while not stop.wait(1.0):
                pass
        except KeyboardInterrupt:
            pass
        finally:
            if server is not None:
                if thread is not None:
                    server.shutdown()  # no more requests
                server.server_close()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if signame:
        print(f"chatlearn reward-server: stopped by {signame[0]}", file=sys.stderr, flush=True)
