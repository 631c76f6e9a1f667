"""The client of a reward server (`chatlearn reward-server`, :mod:`chatlearn.models.hf.reward_server`): what
`ModelReward` runs instead of a local model when ``models.<name>.args_dict.remote_url`` is set.

Standard library only (``urllib``), JSON bodies (the wire format is in the server's docstring). Texts go in
requests of ``remote_batch_size``. A request that fails in a way a server can recover from (connection refused
or reset, no answer within ``remote_timeout_s``, a 5xx) is sent again, up to ``remote_retries`` times, after
waits of ``remote_backoff_s``, doubling; so a server restarted between two batches, or during one, costs a
retry, not the run. A server that stays down is a one-line `RunError` naming the URL, after at most
``(remote_retries + 1) * remote_timeout_s`` plus the waits. A 4xx (the server read the request and refused it),
a body that is not the server's JSON, or the wrong number of scores is a RunError at once: sending it again
would get the same answer. Setup asks ``/health`` with the same retries, so a server that is not up is said
before the first batch, with the command that starts one.

Requests go straight to the URL: the environment's HTTP proxies (``http_proxy``...) are not used, as a reward
server is a machine of the cluster, not of the internet.
"""

import http.client
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

from chatlearn.utils.errors import RunError


def url_problem(url: str) -> str | None:
    """What is wrong with ``url`` as a reward server's address (None: nothing)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{url!r} is not an http(s) URL with a host, e.g. http://127.0.0.1:8765"
    if parts.query or parts.fragment:
        return f"{url!r} has a query or fragment; give the server's address only, e.g. http://127.0.0.1:8765"
    try:
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError as exc:
        return f"{url!r}: {exc}"
    return None


class _Retry(Exception):
    """A failure worth another try: its message says what happened."""


class RemoteReward:
    """Scores texts on the reward server at ``url``; ``owner`` (the model's name) starts every error."""

    def __init__(self, url: str, batch_size: int = 32, timeout_s: float = 60.0, retries: int = 3,
                 backoff_s: float = 1.0, owner: str = "reward") -> None:
        problem = url_problem(url)
        if problem is not None:
            raise ValueError(problem)
        self.url = url.rstrip("/")
        self.batch_size = batch_size
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.owner = owner
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    @classmethod
    def of(cls, args: Any, owner: str) -> "RemoteReward":
        """The client ``ModelRewardArgs`` describe (``remote_url``, ``remote_batch_size``, ...)."""
        return cls(args.remote_url, args.remote_batch_size, args.remote_timeout_s, args.remote_retries,
                   args.remote_backoff_s, owner)

    @property
    def start_command(self) -> str:
        """The command that starts a server on this URL's port."""
        port = urllib.parse.urlsplit(self.url).port or (443 if self.url.startswith("https") else 80)
        return f"chatlearn reward-server MODEL_PATH --port {port}"

    def health(self) -> dict:
        """The server's ``/health``, tried as a batch is; a RunError naming the URL and the command that starts a
        server when it does not answer."""
        try:
            answer = self._call("/health", None)
        except _Retry as exc:
            raise RunError(f"{self.owner}: no reward server answers at {self.url} ({exc}); start one there with "
                           f"`{self.start_command}`, or fix models.{self.owner}.args_dict.remote_url") from None
        if not isinstance(answer, dict) or answer.get("status") != "ok":
            raise RunError(f"{self.owner}: {self.url}/health answered {_short(answer)}, not a reward server's "
                           f"{{\"status\": \"ok\"}}; is it a chatlearn reward-server?")
        return answer

    def score(self, texts: Sequence[str]) -> list[float]:
        """One score per text, in order, in requests of ``batch_size`` texts."""
        out: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            chunk = list(texts[start:start + self.batch_size])
            try:
                answer = self._call("/score", {"texts": chunk})
            except _Retry as exc:
                raise RunError(f"{self.owner}: the reward server at {self.url} did not score a batch of "
                               f"{len(chunk)} texts ({exc}); is it still running? (`{self.start_command}`)") from None
            out += self._scores(answer, len(chunk))
        return out

    def _scores(self, answer: Any, n: int) -> list[float]:
        scores = answer.get("scores") if isinstance(answer, dict) else None
        if not isinstance(scores, list):
            raise RunError(f"{self.owner}: the reward server at {self.url} answered {_short(answer)}, without a "
                           "list of scores; is it a chatlearn reward-server?")
        if len(scores) != n:
            raise RunError(f"{self.owner}: the reward server at {self.url} returned {len(scores)} scores for {n} "
                           "texts")
        for i, value in enumerate(scores):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise RunError(f"{self.owner}: the reward server at {self.url} returned a score that is not a "
                               f"number ({_short(value)}, text {i} of the batch)")
        return [float(v) for v in scores]  # finiteness: ModelReward checks it, naming the sample

    def _call(self, path: str, payload: dict | None) -> Any:
        """The server's JSON answer to GET ``path`` (``payload`` None) or a POST of ``payload``, tried
        ``retries + 1`` times; _Retry saying the last failure, how many tries and for how long."""
        begun = time.monotonic()
        for attempt in range(self.retries + 1):
            try:
                return self._once(path, payload)
            except _Retry as exc:
                if attempt == self.retries:
                    tries = f"{attempt + 1} tries" if attempt else "1 try"
                    raise _Retry(f"{exc}; {tries} in {time.monotonic() - begun:.1f}s") from None
            time.sleep(self.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")

    def _once(self, path: str, payload: dict | None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(self.url + path, data=data, method="GET" if data is None else "POST",
                                         headers={"Content-Type": "application/json", "Accept": "application/json"})
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:  # before URLError, its base: the server answered
            message = _error_message(exc)
            if exc.code >= 500 or exc.code in (408, 429):
                raise _Retry(f"HTTP {exc.code}: {message}") from None
            raise RunError(f"{self.owner}: the reward server at {self.url} refused {path}: HTTP {exc.code}: "
                           f"{message}") from None
        except urllib.error.URLError as exc:
            raise _Retry(self._describe(exc.reason)) from None
        except (OSError, http.client.HTTPException) as exc:  # timeouts, resets, a server gone mid-answer
            raise _Retry(self._describe(exc)) from None
        try:
            return json.loads(body)
        except (ValueError, UnicodeDecodeError):
            raise RunError(f"{self.owner}: {self.url}{path} answered {_short(body)}, not JSON; is it a chatlearn "
                           "reward-server?") from None

    def _describe(self, reason: Any) -> str:
        if isinstance(reason, TimeoutError):  # socket.timeout too
            return f"no answer within remote_timeout_s={self.timeout_s:g}s"
        if isinstance(reason, ConnectionRefusedError):
            return "connection refused"
        if isinstance(reason, http.client.RemoteDisconnected | ConnectionResetError | http.client.IncompleteRead):
            return "the server closed the connection without an answer"
        return " ".join(str(reason).split()) or type(reason).__name__


def _error_message(exc: urllib.error.HTTPError) -> str:
    """The ``error`` of a reward server's JSON error body, else the HTTP reason."""
    try:
        body = json.loads(exc.read())
    except (ValueError, OSError, http.client.HTTPException):
        return str(exc.reason)
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return " ".join(body["error"].split())
    return str(exc.reason)


def _short(value: Any, limit: int = 80) -> str:
    """``value`` in one line of at most ``limit`` characters, for a message."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    text = " ".join((value if isinstance(value, str) else json.dumps(value, default=str)).split())
    if len(text) > limit:
        text = text[:limit] + "..."
    return repr(text) if isinstance(value, str) else text
