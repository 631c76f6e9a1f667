"""The environment layer of multi-turn rollouts (no Ray): loading and checking an environment, observations
rendered as each family's chat template renders a tool turn, the tool environment and the calculator task."""

import pytest

from chatlearn.envs.base import EnvError, check_reset, check_step, load_environment
from chatlearn.envs.render import ObservationRenderer
from chatlearn.envs.rewards import env_reward
from chatlearn.models.hf.tiny import build_char_tokenizer, build_family_tokenizer
from chatlearn.tasks.agent_calculator import CalculatorTask, call_text, digits_score, eval_metrics, make_records
from chatlearn.tasks.higher_lower import HigherLower


def test_load_environment_names_what_is_wrong():
    assert load_environment("chatlearn.tasks.higher_lower:HigherLower") is HigherLower
    with pytest.raises(EnvError, match="chatlearn.tasks.agent_calculator:make_records is not an environment class"):
        load_environment("chatlearn.tasks.agent_calculator:make_records")
    with pytest.raises(ValueError, match="nosuchmodule"):
        load_environment("nosuchmodule:Env")


def test_check_step_and_reset_refuse_what_cannot_be_used():
    assert check_step(("obs", 1, 0, {}), "w") == ("obs", 1.0, False, {})
    for bad, what in ((("obs", 1.0, True), ".*, not \\(observation, reward, done, info\\)"),
                      (("obs", "x", True, {}), "reward 'x', not a number"),
                      (("obs", float("nan"), True, {}), "reward nan, not a finite number"),
                      ((3, 1.0, True, {}), "observation '3', not a string"),
                      (("obs", 1.0, True, None), "info 'None', not a dict")):
        with pytest.raises(EnvError, match="env X on sample 3: step returned " + what):
            check_step(bad, "env X on sample 3")
    check_reset(None, "w")
    check_reset("", "w")
    with pytest.raises(EnvError, match="reset returned 'hello'; the record's prompt opens the conversation"):
        check_reset("hello", "w")


@pytest.mark.parametrize("family", ["qwen2", "llama", "mistral"])
def test_an_observation_follows_the_answer_as_the_chat_template_renders_the_conversation(family):
    """prompt + answer + EOS + the observation's ids is, token for token, the template's own rendering of the
    conversation with the tool turn and the next generation prompt (Mistral's template has no tool role: a
    user turn holding <tool_response>). The answer is tokenized in context, as the policy would have drawn it."""
    tok = build_family_tokenizer(family)
    renderer = ObservationRenderer(tok)
    assert renderer.role == ("user" if family == "mistral" else "tool")
    user = [{"role": "user", "content": "12+30+7"}]
    answer = call_text("12+30+7")
    tool = "49" if renderer.role == "tool" else "<tool_response>\n49\n</tool_response>"
    whole = tok.apply_chat_template([*user, {"role": "assistant", "content": answer},
                                     {"role": renderer.role, "content": tool}], tokenize=False,
                                    add_generation_prompt=True)
    head = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True) + answer + tok.eos_token
    ids = tok(whole, add_special_tokens=False)["input_ids"]
    prefix = tok(head, add_special_tokens=False)["input_ids"]
    assert ids[:len(prefix)] == prefix  # the answer's EOS ends where the template's message ends
    assert ids[len(prefix):] == renderer.ids("49")


def test_without_a_template_the_observation_sits_between_separators():
    char = build_char_tokenizer()
    renderer = ObservationRenderer(char)
    assert not renderer.templated and renderer.separator == " "  # the char vocabulary has no newline
    assert char.decode(renderer.ids("lower")) == " lower "


def test_the_calculator_task_runs_calls_reports_malformed_ones_and_judges_the_final_answer():
    task = CalculatorTask()
    task.reset({"answer": "1368", "sample_id": 0, "env_seed": 1})
    obs, reward, done, info = task.step("let me see " + call_text("123+456+789"))
    assert (obs, reward, done, info) == ("1368", 0.0, False, {"tool_calls": 1, "tool_errors": 0})
    obs, reward, done, info = task.step('<tool_call>\n{"name":"calculator","arguments":{"expr":"1"}}\n</tool_call>')
    assert obs.startswith("Error:") and "expression" in obs and not done and info["tool_errors"] == 1
    obs, reward, done, info = task.step("<tool_call>{not json</tool_call>" + call_text("2*3"))
    assert info == {"tool_calls": 2, "tool_errors": 1} and obs.count("<tool_response>") == 2 and "6" in obs
    assert task.step("The sum is 1368") == ("", 1.0, True, {})
    task.reset({"answer": "1368", "sample_id": 1, "env_seed": 2})
    assert task.step("1378")[1] == pytest.approx(0.3)  # three digits in place
    assert digits_score("no digits", "1368") == 0.0 and digits_score("368", "1368") == pytest.approx(0.3)


def test_calculator_records_are_seeded_sums_and_the_eval_hook_counts_tool_use():
    a, b = make_records(5, seed=1), make_records(5, seed=1)
    assert a == b and a != make_records(5, seed=2)
    for rec in a:
        terms = [int(x) for x in rec["prompt"][0]["content"].split("+")]
        assert len(terms) == 3 and all(100 <= x < 1000 for x in terms) and rec["answer"] == str(sum(terms))
    results = [{"env_reward": 1.0, "tool_calls": 1}, {"env_reward": 0.3, "tool_calls": 0}]
    assert eval_metrics(results, {}) == {"eval_exact_match": 0.5, "eval_called_tool": 0.5}
    assert env_reward({"env_reward": 0.75}) == 0.75


def test_higher_lower_says_higher_or_lower_until_the_guess_is_right():
    game = HigherLower(max_guesses=3)
    game.reset({"answer": "7"})
    assert game.step("3") == ("higher", 0.0, False, {})
    assert game.step("x") == ("say a digit", 0.0, False, {})
    assert game.step("7") == ("", pytest.approx(0.5), True, {})  # right on the third guess
    game.reset({"answer": "2"})
    assert game.step("5")[0] == "lower"
    assert game.step("4")[0] == "lower"
    assert game.step("4") == ("", pytest.approx(0.25 * (1 - 2 / 9)), True, {})  # out of guesses: closeness


class CountDown:
    """A Gymnasium-style text environment: say the next number of a count down from a seeded start."""

    def __init__(self, top: int = 5):
        self.top = top

    def reset(self, seed=None):
        self.n = self.top + seed % 3
        return f"count down from {self.n}", {}

    def step(self, action):
        right = action.strip() == str(self.n - 1)
        self.n -= 1
        return str(self.n), float(right), self.n <= 0, not right, {"right": right}


def test_a_gymnasium_style_text_environment_is_wrapped_directly():
    from chatlearn.envs.gym import GymTextEnv

    env = GymTextEnv(factory=f"{__name__}:CountDown", kwargs={"top": 5})
    assert env.reset({"env_seed": 4}) is None  # starts at 5 + 4 % 3 = 6
    assert env.step("5") == ("5", 1.0, False, {"right": True})
    assert env.step("3") == ("4", 0.0, True, {"right": False})  # truncated on a wrong count
    with pytest.raises(ValueError, match="nosuch"):
        GymTextEnv(factory="nosuch:make")
