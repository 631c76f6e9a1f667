"""The environment layer of multi-turn rollouts (no Ray): loading and checking an environment, observations
rendered as each family's chat template renders a tool turn, the tool environment and the calculator task."""

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest

from chatlearn.envs.base import EnvError, Environment, check_reset, check_step, load_environment
from chatlearn.envs.render import ObservationRenderer, split_tool_responses
from chatlearn.envs.tool_env import ToolEnvironment
from chatlearn.models.hf.tiny import build_char_tokenizer, build_family_tokenizer
from chatlearn.tasks.agent_calculator import (
    CALL_PROBABILITY,
    CalculatorTask,
    _rows,
    call_text,
    digits_score,
    env_reward,
    eval_metrics,
    last_integer,
    make_records,
)
from chatlearn.tasks.higher_lower import HigherLower

DATA = Path(__file__).resolve().parents[1] / "configs" / "data"


class NoStep:
    def reset(self, sample):
        return None


def test_load_environment_names_what_is_wrong():
    assert load_environment("chatlearn.tasks.higher_lower:HigherLower") is HigherLower
    with pytest.raises(EnvError, match="chatlearn.tasks.agent_calculator:make_records is not an environment class.*"
                                       "it is a function"):
        load_environment("chatlearn.tasks.agent_calculator:make_records")
    with pytest.raises(EnvError, match=f"{__name__}:NoStep is not an environment class.*it has no step method"):
        load_environment(f"{__name__}:NoStep")
    with pytest.raises(ValueError, match="'nosuchmodule:Env': cannot import module 'nosuchmodule'"):
        load_environment("nosuchmodule:Env")
    with pytest.raises(ValueError, match="has no attribute 'Nope'"):
        load_environment("chatlearn.tasks.higher_lower:Nope")
    with pytest.raises(NotImplementedError, match="Environment.step"):
        Environment().step("a")  # the base class is the interface only
    assert issubclass(EnvError, RuntimeError)


def test_check_step_and_reset_refuse_what_cannot_be_used():
    assert check_step(("obs", 1, 0, {}), "w") == ("obs", 1.0, False, {})
    assert check_step(("", np.float32(0.5), np.bool_(True), {"tool_calls": 1}), "w") == ("", 0.5, True,
                                                                                           {"tool_calls": 1})
    for bad, what in ((("obs", 1.0, True), ".*, not \\(observation, reward, done, info\\)"),
                      (["obs", 1.0, True, {}], ".*, not \\(observation, reward, done, info\\)"),
                      (("obs", "x", True, {}), "reward 'x', not a number"),
                      (("obs", None, True, {}), "reward None, not a number"),
                      (("obs", float("nan"), True, {}), "reward nan, not a finite number"),
                      (("obs", float("inf"), True, {}), "reward inf, not a finite number"),
                      ((3, 1.0, True, {}), "observation '3', not a string"),
                      (("obs", 1.0, "False", {}), "done 'False', not a bool"),  # truthy: would end the talk
                      (("obs", 1.0, None, {}), "done None, not a bool"),
                      (("obs", 1.0, np.array([True, False]), {}), "done '\\[ True False\\]', not a bool"),
                      (("obs", 1.0, True, None), "info 'None', not a dict")):
        with pytest.raises(EnvError, match="env X on sample 3: step returned " + what):
            check_step(bad, "env X on sample 3")
    check_reset(None, "w")
    check_reset("", "w")
    with pytest.raises(EnvError, match="env X: reset returned 'hello'; the record's prompt opens the conversation"):
        check_reset("hello", "env X")


def _template_conversation(tok, messages, answer):
    """The template's own rendering of the whole conversation, and of its prefix up to the answer's EOS."""
    user = messages[:1]
    whole = tok.apply_chat_template([*user, {"role": "assistant", "content": answer}, *messages[1:]],
                                    tokenize=False, add_generation_prompt=True)
    head = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True) + answer + tok.eos_token
    return whole, head


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "mistral"])
def test_an_observation_follows_the_answer_as_the_chat_template_renders_the_conversation(family):
    """prompt + answer + EOS + the observation's ids is, token for token, the template's own rendering of the
    conversation with the tool turn and the next generation prompt (Mistral's template has no tool role: a user
    turn holding <tool_response>). Ids, not only text, are equal in every family: the observation's tokens start
    right after the answer's EOS, a special token no BPE merge crosses. The answer is tokenized in context, as the
    policy would have drawn it."""
    tok = build_family_tokenizer(family)
    renderer = ObservationRenderer(tok)
    assert renderer.role == ("user" if family == "mistral" else "tool")
    user = {"role": "user", "content": "12+30+7"}
    tool = "49" if renderer.role == "tool" else "<tool_response>\n49\n</tool_response>"
    whole, head = _template_conversation(tok, [user, {"role": renderer.role, "content": tool}], call_text("12+30+7"))
    ids = tok(whole, add_special_tokens=False)["input_ids"]
    prefix = tok(head, add_special_tokens=False)["input_ids"]
    assert ids[:len(prefix)] == prefix  # the answer's EOS ends where the template's message ends
    assert ids[len(prefix):] == renderer.ids("49")
    assert whole == head + renderer.text("49")

    # two calls' results (ToolEnvironment's blocks) are two tool messages, or one user turn holding both blocks
    two = "<tool_response>\n6\n</tool_response>\n<tool_response>\n8\n</tool_response>"
    after = ([{"role": "tool", "content": "6"}, {"role": "tool", "content": "8"}] if renderer.role == "tool"
             else [{"role": "user", "content": two}])
    whole, head = _template_conversation(tok, [user, *after], call_text("2*3") + call_text("2*4"))
    assert tok(whole, add_special_tokens=False)["input_ids"] == (tok(head, add_special_tokens=False)["input_ids"]
                                                                  + renderer.ids(two))


def test_a_template_that_refuses_the_tool_role_gets_a_user_turn_and_one_without_eos_is_refused():
    tok = build_family_tokenizer("qwen2")
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
                         "{% endif %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                         "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    renderer = ObservationRenderer(tok)
    assert renderer.role == "user"
    assert renderer.text("49") == ("\n<|im_start|>user\n<tool_response>\n49\n</tool_response><|im_end|>\n"
                                   "<|im_start|>assistant\n")
    tok.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    with pytest.raises(ValueError, match="does not end an answer with its EOS '<\\|im_end\\|>'"):
        ObservationRenderer(tok).ids("49")


def test_several_tool_responses_are_split_and_anything_else_is_one_observation():
    assert split_tool_responses("<tool_response>\n6\n</tool_response>\n<tool_response>\na\nb\n</tool_response>") == [
        "6", "a\nb"]
    assert split_tool_responses("<tool_response>\n6\n</tool_response>") is None  # one: already how it is shown
    assert split_tool_responses("<tool_response>\n6\n</tool_response> and <tool_response>\n8\n</tool_response>") \
        is None
    assert split_tool_responses("6") is None


def test_without_a_template_the_observation_sits_between_separators():
    char = build_char_tokenizer()
    renderer = ObservationRenderer(char)
    assert not renderer.templated and renderer.separator == " "  # the char vocabulary has no newline
    assert char.decode(renderer.ids("lower")) == " lower "
    assert char.bos_token_id not in renderer.ids("lower")  # no special tokens in the middle of a conversation


def test_the_tool_environment_runs_calls_reports_malformed_ones_and_judges_the_final_answer():
    class Echo(ToolEnvironment):
        def judge(self, answer):
            return float(len(answer))

    env = Echo()
    env.reset({"sample_id": 0, "env_seed": 1})
    assert env.step(call_text("2+2")) == ("4", 0.0, False, {"tool_calls": 1, "tool_errors": 0})
    obs, reward, done, info = env.step('<tool_call>\n{"name":"calculator","arguments":{"expr":"1"}}\n</tool_call>')
    assert obs.startswith("Error:") and "'expression'" in obs and (reward, done) == (0.0, False)
    assert info == {"tool_calls": 1, "tool_errors": 1}
    obs, reward, done, info = env.step("<tool_call>{not json</tool_call>" + call_text("2*3") + call_text("1/0"))
    assert info == {"tool_calls": 3, "tool_errors": 2}
    assert split_tool_responses(obs) == [
        "Error: the tool call is not valid JSON (Expecting property name enclosed in double quotes at line 1 column "
        '2); write {"name": <tool name>, "arguments": {...}} inside <tool_call></tool_call>', "6",
        "Error: division by zero"]
    obs, _, _, info = env.step('<tool_call>{"name": "search", "arguments": {}}</tool_call>')
    assert obs == "Error: unknown tool 'search'; the tools are 'calculator'" and info["tool_errors"] == 1
    obs, _, _, info = env.step("<tool_call>" + '{"name":"calculator","arguments":{"expression":"1"}}')
    assert obs == "Error: a <tool_call> block is not closed with </tool_call>" and info["tool_errors"] == 1
    assert (env.calls, env.errors, env.succeeded) == (7, 5, 2)
    assert env.step("done") == ("", 4.0, True, {})
    env.reset({"sample_id": 1, "env_seed": 2})
    assert (env.calls, env.errors, env.succeeded) == (0, 0, 0)
    with pytest.raises(ValueError, match="^tools: unknown tool 'search' \\(known: calculator, python\\)$"):
        Echo(tools=["calculator", "search"])
    with pytest.raises(ValueError, match="one tool or more"):
        Echo(tools=[])
    with pytest.raises(NotImplementedError, match="ToolEnvironment.judge"):
        ToolEnvironment().step("no call")


def test_the_calculator_task_judges_the_last_integer_with_shaping_below_a_right_answer():
    task = CalculatorTask()
    task.reset({"answer": "1368", "sample_id": 0, "env_seed": 1})
    assert task.step("let me see " + call_text("123+456+789")) == ("1368", 0.0, False,
                                                                   {"tool_calls": 1, "tool_errors": 0})
    assert task.step("The sum is 1,368.") == ("", 1.0, True, {})  # right after a call: 1.0, not more
    task.reset({"answer": "1368", "sample_id": 1, "env_seed": 2})
    assert task.step("123+456+789=1378")[1:3] == (pytest.approx(0.3), True)  # three digits in place, no call
    task.reset({"answer": "1368", "sample_id": 2, "env_seed": 3})
    task.step('<tool_call>{"name":"calculator","arguments":{}}</tool_call>')  # malformed: no call credit
    assert task.step("1378")[1] == pytest.approx(0.3)
    task.reset({"answer": "1368", "sample_id": 3, "env_seed": 4})
    task.step(call_text("1+1"))  # a call that ran: 0.1 once, whatever it computed
    task.step(call_text("2+2"))
    assert task.step("1378")[1] == pytest.approx(0.4)
    task.reset({"answer": "1368", "sample_id": 4, "env_seed": 5})
    assert task.step("I do not know")[1] == 0.0
    assert last_integer("a 12, then 1,368.") == "1368" and last_integer("x") is None
    assert digits_score("no digits", "1368") == 0.0 and digits_score("368", "1368") == pytest.approx(0.3)
    assert digits_score("01368", "1368") == 1.0 and digits_score("13680", "1368") == 0.0  # place value, aligned right
    assert digits_score("848", "848") == 1.0 and digits_score("840", "848") == pytest.approx(0.2)


def test_calculator_records_are_seeded_sums_shipped_as_generated_and_the_eval_hook_counts_tool_use():
    a, b = make_records(5, seed=1), make_records(5, seed=1)
    assert a == b and a != make_records(5, seed=2)
    for rec in a:
        terms = [int(x) for x in rec["prompt"][0]["content"].split("+")]
        assert len(terms) == 3 and all(100 <= x < 1000 for x in terms) and rec["answer"] == str(sum(terms))
    shipped = {name: [json.loads(line) for line in (DATA / f"agent_calculator_{name}.jsonl").read_text().splitlines()]
               for name in ("train", "eval")}
    assert shipped == {"train": make_records(2048, seed=1), "eval": make_records(64, seed=2)}
    train_prompts = {r["prompt"][0]["content"] for r in shipped["train"]}
    assert not train_prompts & {r["prompt"][0]["content"] for r in shipped["eval"]}  # no eval prompt trained on
    results = [{"env_reward": 1.0, "tool_calls": 1, "scores": 1.0}, {"env_reward": 0.3, "tool_calls": 0},
               {"env_reward": 0.4, "tool_calls": 3}, {"env_reward": 0.0, "tool_calls": 0}]
    assert eval_metrics(results, {}) == pytest.approx({"eval_reward_mean": 0.425, "eval_exact_match": 0.25,
                                                       "eval_called_tool": 0.5, "eval_tool_calls_mean": 1.0})
    assert eval_metrics([{"scores": 0.5}], {}) == {"eval_reward_mean": 0.5, "eval_exact_match": 0.0,
                                                   "eval_called_tool": 0.0}
    assert env_reward({"env_reward": 0.75}) == 0.75


def test_the_calculator_warm_up_trains_on_conversations_as_a_rollout_holds_them():
    """`warm_start`'s rows (the tiny Qwen2 of configs/tiny_qwen2_calculator.yaml): a call is the prompt, the call
    and its EOS, the calculator's result rendered as the template's tool turn (the renderer rollouts use), then
    the result and EOS, the loss on both answers and not on the prompt or the tool turn; a guess is a wrong sum in
    words. The first answer token is trained in a share of the calls that makes a call the first token with
    probability CALL_PROBABILITY."""
    tok = build_family_tokenizer("qwen2")
    renderer = ObservationRenderer(tok)
    records = make_records(600, seed=5)
    ids, attention, mask = _rows(tok, renderer, records, random.Random(0))
    eos = [tok.eos_token_id]
    firsts = {"call": 0, "guess": 0}
    for rec, row, att, weights in zip(records, ids, attention, mask, strict=True):
        n = int(att.sum())
        assert att[:n].all() and not att[n:].any() and not weights[n:].any()
        row, weights = row[:n].tolist(), weights[:n].tolist()
        prompt = tok(tok.apply_chat_template(rec["prompt"], tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
        assert row[:len(prompt)] == prompt and not any(weights[:len(prompt)])
        answer, learned = row[len(prompt):], weights[len(prompt):]
        call = tok(call_text(rec["prompt"][0]["content"]), add_special_tokens=False)["input_ids"] + eos
        if answer[:len(call)] == call:
            env = CalculatorTask()
            env.reset(rec)
            result = env.step(tok.decode(call[:-1]))[0]
            assert result == rec["answer"]
            tool_turn, final = renderer.ids(result), tok(result, add_special_tokens=False)["input_ids"] + eos
            assert answer == call + tool_turn + final
            assert learned[1:] == [1.0] * (len(call) - 1) + [0.0] * len(tool_turn) + [1.0] * len(final)
            firsts["call"] += learned[0] == 1.0
        else:
            text = tok.decode(answer[:-1])
            assert answer[-1:] == eos and learned == [1.0] * len(answer)
            assert re.fullmatch(r"The sum is \d+\.", text) and len(last_integer(text)) == len(rec["answer"])
            assert digits_score(text, rec["answer"]) < 1.0
            firsts["guess"] += 1
    assert 0.4 < sum(firsts.values()) / len(records) < 0.9  # about 1/2 + 1/6: guesses and the calls deciding
    assert firsts["call"] / sum(firsts.values()) == pytest.approx(CALL_PROBABILITY, abs=0.06)


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
    assert env.reset({"env_seed": 4}) is None  # starts at 5 + 4 % 3 = 6; the inner first observation is dropped
    assert env.env.n == 6
    assert env.step("5") == ("5", 1.0, False, {"right": True})
    assert env.step("3") == ("4", 0.0, True, {"right": False})  # truncated on a wrong count
    env.reset({"env_seed": 5})  # the same seed gives the same game
    assert env.env.n == 7 and env.step("6")[1:3] == (1.0, False)
    assert env.step("5")[1:3] == (1.0, False) and env.step("4")[1:3] == (1.0, False)
    assert env.step("3") == ("3", 1.0, False, {"right": True})
    assert env.step("2") == ("2", 1.0, False, {"right": True})
    assert env.step("1") == ("1", 1.0, False, {"right": True})
    assert env.step("0") == ("0", 1.0, True, {"right": True})  # terminated at zero
    with pytest.raises(ValueError, match="nosuch"):
        GymTextEnv(factory="nosuch:make")


def test_the_calculator_config_checks_and_builds_its_policy_with_the_warm_start():
    """configs/agent_calculator.yaml passes the config checks as shipped: GRPO over CalculatorTask conversations,
    every model the warm-started tiny Qwen2 (built on first use; bench/agent.py runs it)."""
    from chatlearn.config import EngineChecks, load_config

    cfg = load_config("agent_calculator", [], [EngineChecks(None)])
    assert cfg.runtime.task_type == "agent" and cfg.runtime.engine == "grpo"
    assert cfg.runtime.agent.env == "chatlearn.tasks.agent_calculator:CalculatorTask"
    specs = {name: cfg.models[name].args_dict["tiny_model"] for name in ("policy", "reference", "ppo_policy")}
    assert all(s["warm_start"] == "calculator" and s["tokenizer"] == "family" for s in specs.values())
    assert len({str(s) for s in specs.values()}) == 1  # one model, built once
