"""A verifiable math reward: the response's final answer checked against the reference with math-verify.

Point a run at it with ``models.<reward>.args_dict.reward_fn: chatlearn.tasks.math_verify:math_reward``. It
reads the sample's ``response`` and its reference answer ``answer`` (another field: the reward's
``args_dict.answer_key``), a bare answer such as ``\\frac{3}{4}`` or a GSM8K solution ending in ``#### 72``.
The final answer of a text is its last ``\\boxed{...}`` (or ``\\fbox{...}``), else its last ``#### answer``
line (`extract_answer`); math-verify decides whether two answers are equal (``0.75`` = ``\\frac{3}{4}`` =
``3/4``, ``1,000`` = ``1000``, ``2x+1`` = ``1+2x``, sets, intervals).

Why a worker process: math-verify bounds its own work with ``signal.alarm``, which only works in a process's
main thread, and rule rewards run in helper threads of Ray workers (`chatlearn.models.rule`), where a stuck call
cannot be stopped: an answer like ``9^{9^{9^{9}}}`` or 50 nested fractions keeps sympy busy for longer than any
batch can wait (no end in 30 s), and a thread left on it spins a CPU until the process exits. So parse and
verify run in a small persistent child process (this file run as a script, one request at a time over a pipe),
with math-verify's alarms off. The child stops slow Python work itself (an interval timer at 80% of the limit,
then it carries on serving); work a timer cannot interrupt (one long C call, such as big-integer arithmetic)
gets the child killed at the hard limit and replaced; either way the answer scores 0. The child also caps its
own CPU time and memory, so even orphaned it cannot spin or swell for ever. A judged answer costs a few
milliseconds (about 0.3 ms of it the pipe), a killed worker about 1 s to replace, and answers longer than
`MAX_ANSWER_CHARS` are never parsed. Timeouts and the rest are counted (`stats`). Linux/macOS only
(the pipe is waited on with ``poll``).
"""

import atexit
import functools
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable

MAX_ANSWER_CHARS = 1000  # a longer final answer is not an answer: it is never parsed and scores 0
DEFAULT_TIMEOUT_S = 5.0  # hard wall-clock limit of judging one sample
_SOFT_FRACTION = 0.8  # the worker stops slow Python work itself at this share of the limit (no restart needed)
FORMAT_WEIGHT = 0.1  # weight of format_reward in math_and_format_reward
_STARTUP_TIMEOUT_S = 60.0  # a worker imports sympy and math-verify and parses once (~1 s unloaded)
_MAX_IDLE_WORKERS = 4
_WORKER_MEMORY_BYTES = 1 << 30  # address-space cap of a worker: a huge number fails there, not in the node

logger = logging.getLogger(__name__)

_BOX_MARKERS = ("\\boxed", "\\fbox")
_BOX_MARKER = re.compile(r"\\(?:boxed|fbox)")
_OPEN_BRACE = re.compile(r"\s*\{")
_BRACE_TOKENS = re.compile(r"\\.|[{}]", re.S)  # an escaped character (\{, \}, \\) is skipped, not counted
# zero-width characters and bidi controls: invisible, so an answer of only these is no answer
_INVISIBLE = dict.fromkeys([0x200B, 0x200C, 0x200D, 0x2060, 0xFEFF, *range(0x202A, 0x202F), *range(0x2066, 0x206A)])
_UNESCAPED_DOLLAR = re.compile(r"(?<!\\)\$")
_THIN_SPACE_GROUP = re.compile(r"(?<=\d)\\[,;:! ](?=\d{3}(?!\d))")  # 1\,000 -> 1000 (math-verify reads 1*0)
_NUMBER_AND_UNIT = re.compile(r"([-+]?\$?\d[\d,]*(?:\.\d+)?)\s+[A-Za-z]{2,}(?:\s+[A-Za-z]+)*\.?")  # 72 clips


def _box_span(text: str, start: int, max_chars: int) -> tuple[int, int] | None:
    """Where the content of the box marker at ``start`` begins and ends; None when its braces are missing,
    unbalanced or hold more than ``max_chars`` characters (no more than ``max_chars + 1`` are ever scanned, so
    a 10 MB response costs no more than a short one)."""
    marker = next(m for m in _BOX_MARKERS if text.startswith(m, start))
    brace = _OPEN_BRACE.match(text, start + len(marker))
    if brace is None:
        return None
    depth, begin = 0, brace.end()
    for token in _BRACE_TOKENS.finditer(text, begin, min(len(text), begin + max_chars + 1)):
        if token.group() == "{":
            depth += 1
        elif token.group() == "}":
            if depth == 0:
                return begin, token.start()
            depth -= 1
    return None


def _boxed(text: str, max_chars: int) -> str | None:
    """The content of the outermost box around the last box marker (``\\boxed{\\frac{1}{\\boxed{2}}}`` is
    ``\\frac{1}{\\boxed{2}}``), else of the last marker's own box; None when that is malformed."""
    last = max(text.rfind(m) for m in _BOX_MARKERS)
    # only a box starting at most max_chars (+ the marker and brace) before can enclose it and still be an answer
    for marker in _BOX_MARKER.finditer(text, max(0, last - max_chars - 16), last):
        span = _box_span(text, marker.start(), max_chars)
        if span is not None and span[1] > last:
            return text[span[0]:span[1]]
    span = _box_span(text, last, max_chars)
    return text[span[0]:span[1]] if span is not None else None


def extract_answer(text: str, max_chars: int = MAX_ANSWER_CHARS) -> str | None:
    """The final answer of ``text``: the content of its last ``\\boxed{...}`` or ``\\fbox{...}`` (nested braces
    fine; a box inside a box gives the outer one's), else what follows its last ``####`` on that line (GSM8K's
    form; only the number of ``72 clips``); stripped. None when there is neither, when the last box is
    malformed (no brace, unbalanced, empty), or when the answer is longer than ``max_chars``. The last box wins
    even if malformed: a truncated final answer is not replaced by an earlier one."""
    if any(m in text for m in _BOX_MARKERS):
        answer = _boxed(text, max_chars)
    else:
        at = text.rfind("####")
        if at < 0:
            return None
        end = text.find("\n", at)
        answer = text[at + 4:end if end >= 0 else len(text)].strip()
        unit = _NUMBER_AND_UNIT.fullmatch(answer) if len(answer) <= max_chars else None
        answer = unit.group(1) if unit else None if len(answer) > max_chars else answer
    answer = answer.translate(_INVISIBLE).strip() if answer is not None else None
    return answer or None


def answer_count(text: str) -> int:
    """How many final-answer markers ``text`` holds (boxes and ``####``; a box inside a box counts twice)."""
    return sum(text.count(m) for m in _BOX_MARKERS) + text.count("####")


def _as_latex(answer: str) -> str:
    """``answer`` in the form math-verify parses best: inline math ``$...$``, after small clean-ups it gets
    wrong on its own (invisible characters, stray ``$``, a box inside the answer, thin-space digit groups)."""
    answer = _UNESCAPED_DOLLAR.sub("", _BOX_MARKER.sub("", answer.translate(_INVISIBLE))).strip()
    return f"${_THIN_SPACE_GROUP.sub('', answer)}$"


def _reference(sample: dict, answer_field: str) -> str:
    """The reference answer of ``sample``: extracted when it is a solution (GSM8K's ``#### 72``, a boxed
    answer), else the field itself. A missing field is a KeyError (the run names the sample)."""
    reference = str(sample[answer_field])
    return extract_answer(reference, max_chars=max(MAX_ANSWER_CHARS, len(reference))) or reference.strip()


# ---------------------------------------------------------------------------------------------------------------
# The worker processes (parent side)

_stats: Counter = Counter()
_stats_lock = threading.Lock()


def _count(key: str) -> int:
    with _stats_lock:
        _stats[key] += 1
        return _stats[key]


def stats() -> dict[str, int]:
    """What this process's math rewards have seen: ``judged`` (answers sent to math-verify), ``equal``,
    ``no_answer`` (none found, malformed or too long), ``timeout`` (the worker was killed; scored 0),
    ``slow`` (stopped by the worker itself at 80% of the limit; scored 0), ``error`` (math-verify raised),
    ``crashed`` (the worker died mid-answer), ``started`` (workers started)."""
    with _stats_lock:
        return dict(_stats)


class _Worker:
    """One child process judging one request at a time: a JSON line in, a JSON line out."""

    def __init__(self) -> None:
        # -P: the script's folder is not put on sys.path, so ``import math_verify`` there is the library
        self.proc = subprocess.Popen([sys.executable, "-P", os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, start_new_session=True)
        self.buffer = b""
        assert self.proc.stdout is not None
        self.poller = select.poll()  # not select.select: it fails on descriptors over 1023, which Ray workers reach
        self.poller.register(self.proc.stdout.fileno(), select.POLLIN)
        _count("started")
        if self._read_line(time.monotonic() + _STARTUP_TIMEOUT_S) != b"ready":
            self.kill()
            raise RuntimeError(f"the math-verify worker did not start (exit code {self.proc.returncode}); is "
                               "math-verify installed in this Python?")

    def judge(self, reference: str, answer: str, timeout_s: float) -> str:
        """``equal``, ``different``, ``slow``, ``error``, ``timeout`` (the worker is killed) or ``crashed``;
        BrokenPipeError when the worker was dead before the request."""
        deadline = time.monotonic() + timeout_s
        request = {"gold": reference, "pred": answer, "soft_s": _SOFT_FRACTION * timeout_s, "cpu_s": timeout_s}
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        try:
            line = self._read_line(deadline)
        except EOFError:
            self.kill()
            return "crashed"
        if line is None:
            self.kill()
            return "timeout"
        return json.loads(line)["status"]

    def _read_line(self, deadline: float) -> bytes | None:
        """The next line from the worker, None at ``deadline``; EOFError when it has exited."""
        assert self.proc.stdout is not None
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.poller.poll(1000 * remaining):
                return None
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                raise EOFError
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL and reap: nothing is left running, not even a zombie."""
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:  # a write to the dead worker may be left in stdin's buffer
                    pass


class _Workers:
    """Idle workers of this process; each call takes one (or starts one) and gives it back, so threads that
    score at once each get their own."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.idle: list[_Worker] = []
        self.pid = os.getpid()

    def take(self) -> _Worker:
        with self.lock:
            if self.pid != os.getpid():  # a forked child must not share its parent's pipes
                self.idle, self.pid = [], os.getpid()
            if self.idle:
                return self.idle.pop()
        return _Worker()

    def give(self, worker: _Worker) -> None:
        with self.lock:
            if worker.alive() and self.pid == os.getpid() and len(self.idle) < _MAX_IDLE_WORKERS:
                self.idle.append(worker)
                return
        worker.kill()

    def close(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, []
        for worker in idle:
            worker.kill()


_workers = _Workers()
atexit.register(_workers.close)


def close_workers() -> None:
    """Stop this process's idle workers (they also exit by themselves when this process does)."""
    _workers.close()


def equivalent(reference: str, answer: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Whether math-verify judges ``answer`` equal to ``reference`` (both bare answers, e.g. from
    `extract_answer`) within ``timeout_s`` of wall-clock time; an answer over `MAX_ANSWER_CHARS`, one that takes
    too long, and one math-verify fails on are not. Safe from any thread."""
    if len(answer) > MAX_ANSWER_CHARS:
        _count("no_answer")
        return False
    _count("judged")
    for attempt in range(2):
        worker = _workers.take()
        try:
            status = worker.judge(_as_latex(reference), _as_latex(answer), timeout_s)
        except BrokenPipeError:  # the idle worker had died (killed from outside): once more on a fresh one
            worker.kill()
            if attempt:
                raise
            continue
        except BaseException:  # never leave a worker busy on an answer nobody waits for
            worker.kill()
            raise
        _workers.give(worker)
        break
    seen = _count(status)
    if status in ("timeout", "slow", "crashed"):
        logger.warning("math reward: answer %r %s after at most %gs (%d so far); it scores 0", answer[:80],
                       "crashed the worker" if status == "crashed" else "timed out", timeout_s, seen)
    return status == "equal"


# ---------------------------------------------------------------------------------------------------------------
# The rewards


def format_reward(sample: dict) -> float:
    """1.0 when the response holds exactly one final answer in a recognised form (one ``\\boxed{}``/``\\fbox{}``
    or one ``####`` line) and it is well formed, else 0.0. Never parses: it costs microseconds."""
    response = sample["response"]
    return float(answer_count(response) == 1 and extract_answer(response) is not None)


def make_math_reward(answer_field: str = "answer", format_weight: float = 0.0,
                     timeout_s: float = DEFAULT_TIMEOUT_S) -> Callable[[dict], float]:
    """A reward function ``reward(sample) -> float``: 1.0 when the response's final answer equals the reference
    in ``sample[answer_field]``, else 0.0; plus ``format_weight * format_reward(sample)``; each sample judged
    within ``timeout_s`` seconds.

    Rule rewards are named in the config by ``module:function``; another answer field is the reward's
    ``args_dict.answer_key`` (`math_reward` takes it), another weight a function of your own module::

        # myrewards.py (next to the config); reward_fn: myrewards:solution_reward
        from chatlearn.tasks.math_verify import make_math_reward
        solution_reward = make_math_reward(answer_field="solution", format_weight=0.2)

    Keep ``models.<reward>.args_dict.timeout_s`` (the run's own limit of one call, 60 s by default) above
    ``timeout_s`` plus a second, so a slow answer scores 0 here rather than stopping the run there.
    """

    def reward(sample: dict) -> float:
        reference = _reference(sample, answer_field)
        answer = extract_answer(sample["response"])
        if answer is None:
            _count("no_answer")
            correct = False
        else:
            correct = equivalent(reference, answer, timeout_s)
        return float(correct) + (format_weight * format_reward(sample) if format_weight else 0.0)

    reward.__doc__ = f"math reward on field {answer_field!r}, format weight {format_weight:g}, {timeout_s:g} s"
    return reward


@functools.cache
def _math_reward(answer_key: str, format_weight: float) -> Callable[[dict], float]:
    return make_math_reward(answer_field=answer_key, format_weight=format_weight)


def math_reward(sample: dict, answer_key: str = "answer") -> float:
    """1.0 when the final answer of ``sample["response"]`` is mathematically equal to ``sample[answer_key]``
    (extracted first when it is a GSM8K solution), else 0.0; judged within `DEFAULT_TIMEOUT_S` seconds, and
    0.0 when it takes longer. The outcome reward of math RL (GRPO on GSM8K / MATH). ``answer_key`` is the
    reward's ``args_dict.answer_key`` where the config sets one."""
    return _math_reward(answer_key, 0.0)(sample)


def math_and_format_reward(sample: dict, answer_key: str = "answer") -> float:
    """`math_reward` + `FORMAT_WEIGHT` (0.1) * `format_reward`: in [0, 1.1]. The small format term rewards a
    single well-formed final answer before the policy gets answers right, without outweighing correctness."""
    return _math_reward(answer_key, FORMAT_WEIGHT)(sample)


# ---------------------------------------------------------------------------------------------------------------
# The worker process itself: ``python -P chatlearn/tasks/math_verify.py`` (started by `_Worker`)


class _Expired(BaseException):
    """Raised by the worker's interval timer; a BaseException, so math-verify's ``except Exception`` lets it
    through."""


def _serve() -> None:
    # the worker's own imports: the training process never loads sympy or sets these signals and limits
    import functools
    import resource
    import signal

    logging.disable(logging.WARNING)  # math-verify warns that its alarms are off, and on each failure
    from math_verify import parse, verify

    def expire(signum: int, frame: object) -> None:
        raise _Expired

    signal.signal(signal.SIGALRM, expire)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business; it closes the pipe
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _, hard_as = resource.getrlimit(resource.RLIMIT_AS)
    if hard_as == resource.RLIM_INFINITY or hard_as > _WORKER_MEMORY_BYTES:
        try:
            resource.setrlimit(resource.RLIMIT_AS, (_WORKER_MEMORY_BYTES, hard_as))
        except (ValueError, OSError):  # macOS does not take it; the hard kill still bounds the time
            pass
    _, hard_cpu = resource.getrlimit(resource.RLIMIT_CPU)

    @functools.lru_cache(maxsize=256)
    def parse_reference(text: str) -> list:
        return parse(text, parsing_timeout=None)  # type: ignore[arg-type]

    def judge(gold: str, pred: str) -> str:
        try:
            equal = verify(parse_reference(gold), parse(pred, parsing_timeout=None),  # type: ignore[arg-type]
                           timeout_seconds=None)
        except Exception:  # a failing answer scores 0 (MemoryError and RecursionError too)
            return "error"
        return "equal" if equal else "different"

    judge("$1$", "$\\frac{x}{2} + 1$")  # load the LaTeX grammar now, not within the first answer's time limit
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # a stray print, from Python or C, goes to stderr and cannot corrupt the replies
    sys.stdout = sys.stderr
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        # SIGXCPU ends it, even orphaned: a backstop well past the parent's wall-clock kill at cpu_s, so that a
        # parent scheduled late on a loaded machine still kills it first
        cpu_limit = int(usage.ru_utime + usage.ru_stime + 2 * request["cpu_s"]) + 2
        if hard_cpu == resource.RLIM_INFINITY or cpu_limit < hard_cpu:
            resource.setrlimit(resource.RLIMIT_CPU, (cpu_limit, hard_cpu))
        try:
            signal.setitimer(signal.ITIMER_REAL, request["soft_s"])
            try:
                status = judge(request["gold"], request["pred"])
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _Expired:
            status = "slow"
        out.write(json.dumps({"status": status}) + "\n")
        out.flush()


if __name__ == "__main__":
    _serve()
