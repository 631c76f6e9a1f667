"""The built-in math reward (chatlearn/tasks/math_verify.py) on a table of hand-written cases: equivalent forms,
GSM8K's ``####`` form, wrong answers, malformed output, and adversarial answers that must score 0 within the
timeout without leaving a worker process spinning; from a non-main thread and through the rule-calling path."""

import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from chatlearn.tasks import math_verify as mv

FAST_TIMEOUT_S = 1.0  # the adversarial cases' limit, so the file stays quick
fast_reward = mv.make_math_reward(timeout_s=FAST_TIMEOUT_S)

GSM8K_SOLUTION = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
                  "altogether in April and May.\n#### 72")

# (reference answer, response, math_reward, format_reward)
CASES = [
    # equivalent forms
    ("42", "The answer is \\boxed{42}.", 1.0, 1.0),
    ("0.75", "\\boxed{\\frac{3}{4}}", 1.0, 1.0),
    ("\\frac{3}{4}", "so \\boxed{0.75}", 1.0, 1.0),
    ("0.75", "\\boxed{3/4}", 1.0, 1.0),
    ("\\frac{3}{4}", "\\boxed{\\dfrac{3}{4}}", 1.0, 1.0),
    ("\\frac12", "\\boxed{0.5}", 1.0, 1.0),
    ("1000", "\\boxed{1,000}", 1.0, 1.0),
    ("1,000", "\\boxed{1000}", 1.0, 1.0),
    ("1000000", "\\boxed{1{,}000{,}000}", 1.0, 1.0),
    ("1000", "\\boxed{1\\,000}", 1.0, 1.0),  # thin-space groups: math-verify alone reads 1*0
    ("1+2x", "\\boxed{2x+1}", 1.0, 1.0),
    ("-7", "\\boxed{-7}", 1.0, 1.0),
    ("\\sqrt{2}/2", "\\fbox{\\frac{\\sqrt{2}}{2}}", 1.0, 1.0),
    ("\\{1,2\\}", "\\boxed{\\{2,1\\}}", 1.0, 1.0),
    ("[1,2)", "\\boxed{[1,2)}", 1.0, 1.0),
    ("\\infty", "\\boxed{\\infty}", 1.0, 1.0),
    ("\\text{(B)}", "\\boxed{B}", 1.0, 1.0),
    ("42", "\\boxed{\\$42}", 1.0, 1.0),
    ("42", "\\boxed{$42$}", 1.0, 1.0),
    ("42", "\\boxed{42\u200b}", 1.0, 1.0),  # a zero-width space
    (42, "\\boxed{42}", 1.0, 1.0),  # a number in the data, not a string
    # percentages: math-verify accepts the number with or without the percent sign, both ways
    ("50\\%", "\\boxed{0.5}", 1.0, 1.0),
    ("50\\%", "\\boxed{50}", 1.0, 1.0),
    ("50", "\\boxed{50\\%}", 1.0, 1.0),
    # and an equation's right-hand side counts as the answer, both ways
    ("x=3", "\\boxed{3}", 1.0, 1.0),
    ("3", "\\boxed{x=3}", 1.0, 1.0),
    # GSM8K: the reference is a solution ending in #### 72, the answer a #### line or a box
    (GSM8K_SOLUTION, "48 + 24 = 72\n#### 72", 1.0, 1.0),
    (GSM8K_SOLUTION, "So she sold \\boxed{72} clips.", 1.0, 1.0),
    (GSM8K_SOLUTION, "#### 72.", 1.0, 1.0),
    (GSM8K_SOLUTION, "#### $72", 1.0, 1.0),
    (GSM8K_SOLUTION, "#### 72 clips", 1.0, 1.0),
    ("#### 1,234", "#### 1234", 1.0, 1.0),
    # nested braces, and which box is the final answer
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{\\boxed{2}}}", 1.0, 0.0),  # the outer box; two markers fail the format
    ("\\frac{x+1}{2}", "\\boxed{\\frac{\\left(x+1\\right)}{2}}", 1.0, 1.0),
    ("5", "First \\boxed{3}, then \\boxed{5}", 1.0, 0.0),  # the last box wins
    ("3", "First \\boxed{3}, then \\boxed{5}", 0.0, 0.0),
    ("5", "\\boxed{5}\n#### 3", 1.0, 0.0),  # a box wins over a #### line
    # wrong answers
    ("42", "\\boxed{41}", 0.0, 1.0),
    ("42", "\\boxed{42.01}", 0.0, 1.0),
    ("42", "\\boxed{42.0000001}", 0.0, 1.0),
    ("-7", "\\boxed{7}", 0.0, 1.0),
    ("2x+1", "\\boxed{2x-1}", 0.0, 1.0),
    ("2x+1", "\\boxed{2y+1}", 0.0, 1.0),
    ("(1,2)", "\\boxed{[1,2]}", 0.0, 1.0),
    ("2", "\\boxed{\\frac12}", 0.0, 1.0),
    ("\\pi", "\\boxed{3.14159}", 0.0, 1.0),
    ("1,5", "\\boxed{1.5}", 0.0, 1.0),  # 1,5 is the set {1, 5}, not a decimal comma
    (GSM8K_SOLUTION, "#### 24", 0.0, 1.0),
    # malformed output
    ("42", "I think it is 42", 0.0, 0.0),
    ("42", "", 0.0, 0.0),
    ("42", "\\boxed{42", 0.0, 0.0),
    ("42", "\\boxed{42}} \\boxed{4", 0.0, 0.0),  # a truncated last box does not fall back to an earlier one
    ("42", "\\boxed{}", 0.0, 0.0),
    ("42", "\\boxed{   }", 0.0, 0.0),
    ("42", "\\boxed 42", 0.0, 0.0),
    ("42", "####", 0.0, 0.0),
    ("42", "\\boxed{\u2603\u00e9\u4e2d\U0001f600}", 0.0, 1.0),  # well formed, but no math
    ("42", "\\boxed{\x00\x01\x7f}", 0.0, 1.0),
    ("42", "\ufffd\udcff\u202e####\u202d", 0.0, 0.0),
    ("42", "\\boxed{" + "4" * 1001 + "}", 0.0, 0.0),  # over MAX_ANSWER_CHARS: never parsed
]


@pytest.mark.parametrize(("reference", "response", "correct", "formatted"), CASES)
def test_math_and_format_reward_table(reference, response, correct, formatted):
    sample = {"prompt": "q", "answer": reference, "response": response}
    assert mv.math_reward(sample) == correct
    assert mv.format_reward(sample) == formatted
    assert mv.math_and_format_reward(sample) == pytest.approx(correct + mv.FORMAT_WEIGHT * formatted)


@pytest.mark.parametrize(("text", "answer"), [
    ("\\boxed{42}", "42"),
    ("a \\boxed{ \\frac{a}{b} } b", "\\frac{a}{b}"),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),  # escaped braces are not structure
    ("\\boxed{\\left\\{ x \\right.}", "\\left\\{ x \\right."),
    ("\\boxed {7}", "7"),
    ("\\fbox{7}", "7"),
    ("\\boxed{1} x \\fbox{2}", "2"),
    ("\\boxed{\\boxed{1} + \\boxed{2}}", "\\boxed{1} + \\boxed{2}"),
    ("text\n#### 1,234\n", "1,234"),
    ("#### 1\n#### 2", "2"),
    ("#### 72 clips.", "72"),  # a number and unit words: the number
    ("#### 2 x", "2 x"),  # a single letter may be a variable: kept
    ("no answer", None),
    ("\\boxed{1", None),
    ("\\boxed{}", None),
    ("\\boxed{" + "x" * 1001 + "}", None),
    ("#### " + "9" * 1001, None),
])
def test_extract_answer(text, answer):
    assert mv.extract_answer(text) == answer


def test_the_reference_field_and_weights_are_configurable_by_a_factory():
    reward = mv.make_math_reward(answer_field="solution", format_weight=0.5)
    assert reward({"solution": GSM8K_SOLUTION, "response": "#### 72"}) == 1.5
    assert reward({"solution": GSM8K_SOLUTION, "response": "#### 71"}) == 0.5
    with pytest.raises(KeyError):  # a missing field is the data's error, named by the run
        reward({"answer": "72", "response": "#### 72"})


def _workers() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if mv.__file__ in " ".join(p.cmdline())]


def _assert_no_busy_worker() -> None:
    """Every worker left is idle: alive, and using no CPU over a short look."""
    workers = _workers()
    assert len(workers) <= mv._MAX_IDLE_WORKERS
    before = {p.pid: sum(p.cpu_times()[:2]) for p in workers}
    time.sleep(0.3)
    for p in workers:
        assert p.status() != psutil.STATUS_ZOMBIE
        assert sum(p.cpu_times()[:2]) - before[p.pid] < 0.05, f"worker {p.pid} is still computing"


ADVERSARIAL = {
    "open parens": "\\boxed{" + "(" * 100_000,
    "open parens, short": "\\boxed{" + "(" * 900 + "}",
    "power tower": "\\boxed{9^{9^{9^{9}}}}",
    "huge power": "\\boxed{10^{10^{10}}}",
    "huge factorial": "\\boxed{100000000!}",
    "nested fractions": "\\boxed{" + "\\frac{1}{" * 60 + "2" + "}" * 60 + "}",
    "nested braces": "\\boxed{" + "{" * 400 + "1" + "}" * 400 + "}",
    "10 MB": "x" * 10_000_000 + "\\boxed{" + "1" * 10_000_000 + "}",
    "10 MB of markers": "\\boxed{" * 1_500_000,
    "10 MB of hashes": "#" * 10_000_000,
}


@pytest.mark.parametrize("response", ADVERSARIAL.values(), ids=ADVERSARIAL.keys())
def test_adversarial_answers_score_zero_within_the_timeout(response):
    started = time.monotonic()
    assert fast_reward({"answer": "5", "response": response}) == 0.0
    # bounded by the limit, with room for a loaded machine (each case unbounded would take minutes or forever)
    assert time.monotonic() - started < FAST_TIMEOUT_S + 5
    _assert_no_busy_worker()


def test_a_stuck_worker_is_killed_at_the_hard_limit_and_replaced(monkeypatch):
    # The worker stops slow Python work itself; with that off, only the parent's hard kill is left.
    assert fast_reward({"answer": "1", "response": "\\boxed{1}"}) == 1.0
    worker = psutil.Process(mv._workers.idle[-1].proc.pid)  # the one the next call takes
    monkeypatch.setattr(mv, "_SOFT_FRACTION", 100.0)
    before = mv.stats()
    started = time.monotonic()
    assert fast_reward({"answer": "5", "response": "\\boxed{9^{9^{9^{9}}}}"}) == 0.0
    assert time.monotonic() - started < FAST_TIMEOUT_S + 1
    assert not psutil.pid_exists(worker.pid) or worker.status() == psutil.STATUS_ZOMBIE
    assert mv.stats()["timeout"] == before.get("timeout", 0) + 1
    assert fast_reward({"answer": "1", "response": "\\boxed{1}"}) == 1.0  # a fresh worker
    assert mv.stats()["started"] == before["started"] + 1
    _assert_no_busy_worker()


def test_the_built_in_rewards_judge_within_five_seconds(monkeypatch):
    limits = []
    monkeypatch.setattr(mv, "equivalent", lambda reference, answer, timeout_s: limits.append(timeout_s) or True)
    assert mv.math_reward({"answer": "5", "response": "\\boxed{5}"}) == 1.0
    assert mv.math_and_format_reward({"answer": "5", "response": "\\boxed{5}"}) == pytest.approx(1.1)
    assert limits == [5.0, 5.0] and mv.DEFAULT_TIMEOUT_S == 5.0


def test_an_orphaned_worker_stops_by_itself():
    """A worker whose process dies mid-answer (a Ray worker killed) ends on its own CPU limit: no stray process
    spins for ever."""
    script = textwrap.dedent(f"""
        import os, threading, time
        from chatlearn.tasks import math_verify as mv
        mv._SOFT_FRACTION = 100.0
        worker = mv._workers.take()
        print(worker.proc.pid, flush=True)
        tower = "$9^{{9^{{9^{{9}}}}}}$"
        threading.Thread(target=worker.judge, args=("$5$", tower, {FAST_TIMEOUT_S}), daemon=True).start()
        time.sleep(0.5)
        os._exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    orphan = psutil.Process(int(out.stdout.split()[0]))  # still spinning: the parent no longer waits for it
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            if orphan.status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.2)
    else:
        orphan.kill()
        pytest.fail("the orphaned worker kept running")


def test_from_other_threads_at_once():
    """Ray runs rule rewards in helper threads, where math-verify's signal timeouts cannot work."""
    samples = [{"answer": str(i), "response": f"\\boxed{{{i}}}"} for i in range(12)]
    results: dict[int, float] = {}

    def score(first: int) -> None:
        for i in range(first, len(samples), 2):
            results[i] = mv.math_reward(samples[i])

    threads = [threading.Thread(target=score, args=(first,)) for first in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {i: 1.0 for i in range(len(samples))}
    _assert_no_busy_worker()


def test_through_the_rule_calling_path():
    from chatlearn.models.rule import RuleSpec, hook_name, score_samples

    spec = RuleSpec(reward_fn="chatlearn.tasks.math_verify:math_and_format_reward", timeout_s=10)
    batch = {"prompt": ["a", "b", "c"], "answer": [GSM8K_SOLUTION, "\\frac{3}{4}", "2"],
             "response": ["#### 72", "\\boxed{0.75} \\boxed{0.75}", "no idea"]}
    assert spec.score(batch) == [pytest.approx(1.1), 1.0, 0.0]
    # an adversarial answer scores 0 inside the rule's own timeout instead of stopping the run
    samples = [{"answer": "5", "response": "\\boxed{9^{9^{9^{9}}}}"}, {"answer": "5", "response": "\\boxed{5}"}]
    assert score_samples(fast_reward, samples, FAST_TIMEOUT_S + 2, hook_name("tests:fast_reward")) == [0.0, 1.0]


def test_per_sample_cost_stays_small():
    """A batch of typical samples (reasoning text, then a boxed or #### answer) costs milliseconds per sample."""
    samples = [{"answer": f"\\frac{{{i}}}{{7}}", "response": "Reasoning. " * 100 + f"\\boxed{{{i}/7}}"}
               for i in range(1, 101)]
    mv.math_reward(samples[0])
    started = time.monotonic()
    assert all(mv.math_reward(s) == 1.0 for s in samples)
    assert (time.monotonic() - started) / len(samples) < 0.1
