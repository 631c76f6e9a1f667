"""Compute flows: tracing a ChatLearn flow into its calls, the built-in engines as flows, and the misuses that are
errors before anything starts (no Ray, no Prefect)."""

import pytest

from chatlearn.config import load_config
from chatlearn.models.base_module import BaseModule
from chatlearn.runtime.compute_flow import BATCH, Environment, FlowError, Trainer, step, trace
from chatlearn.runtime.engine import Engine, GRPOMathEngine, RLHFEngine
from chatlearn.runtime.engines import resolve_engine
from tests.conftest import REPO
from tests.custom_flow_example import documented_engine


class M(BaseModule):
    pass


def calls(flow):
    return [(n.name, n.inputs) for n in flow.nodes]


def test_chatlearns_documented_flow_traces_into_its_calls_and_their_inputs():
    engine = documented_engine(M, M, M, M, M, M, [{"prompt": "a"}], [{"prompt": "b"}])
    plan, steps = engine.compile(None)
    assert calls(plan.environment) == [("policy.forward_step", [BATCH]), ("reference.forward_step", [0]),
                                       ("value.forward_step", [0]), ("reward.forward_step", [0, 1, 2])]
    assert [n.level for n in plan.environment.nodes] == [0, 1, 1, 2]  # reference and value do not read each other
    assert plan.environment.returns == [3] and plan.environment.outputs() == [3] and steps == {}
    assert calls(plan.trainer) == [("ppo_policy.train_step", [BATCH]), ("ppo_value.train_step", [BATCH])]
    assert calls(plan.evaluator) == [("policy.eval_step", [BATCH]), ("reward.eval_step", [0])]
    assert plan.producer == "policy" and plan.trainers == ["ppo_policy", "ppo_value"] and plan.export == "ppo_policy"
    assert plan.sync == [("ppo_policy", "policy"), ("ppo_value", "value")]
    assert list(engine.modules) == ["policy", "reference", "value", "reward", "ppo_policy", "ppo_value"]
    # tracing leaves the modules as they were; the datasets given in code replace the config's files
    assert not any("forward_step" in vars(m) for m in engine.modules.values())
    resolved = engine.resolve(load_config(f"{REPO}/configs/default.yaml"))
    assert resolved.dataset == [{"prompt": "a"}] and resolved.eval_dataset == [{"prompt": "b"}]


def test_a_returned_call_upstream_of_another_is_not_merged_twice():
    # ChatLearn's RLHFEngine returns (value_out, reward_out): the reward's output already carries the value's
    plan = resolve_engine(load_config(f"{REPO}/configs/default.yaml")).plan
    assert plan.environment.returns == [2, 3] and plan.environment.outputs() == [3]


def test_the_built_in_engines_are_their_flows():
    for config, engine, env in [
        ("default", "rlhf", ["policy.forward_step", "reference.forward_step", "value.forward_step",
                             "reward.forward_step"]),
        ("grpo", "grpo", ["policy.forward_step", "reference.forward_step", "reward.forward_step"]),
        ("grpo_math", "grpo_math", ["policy.forward_step", "reference.forward_step", "reward1.score_step",
                               "reward.forward_step"]),
        ("online_dpo", "online_dpo", ["policy.forward_step", "reference.forward_step", "reward.forward_step"]),
        ("dpo", "dpo", ["reference.forward_step"]),
    ]:
        cfg = load_config(f"{REPO}/configs/{config}.yaml")
        plan = resolve_engine(cfg, engine=engine).plan
        assert [n.name for n in plan.environment.nodes] == env, engine
    # GRPO's old log-probs from the trainer: the flow reads ppo_policy's args_dict when traced for the run
    cfg = load_config(f"{REPO}/configs/grpo.yaml", ["models.ppo_policy.args_dict.old_logprobs=trainer"])
    plan = resolve_engine(cfg).plan
    assert [n.name for n in plan.environment.nodes] == ["policy.forward_step", "reference.forward_step",
                                                          "ppo_policy.forward_step", "reward.forward_step"]
    assert plan.environment.nodes[-1].inputs == [0, 1, 2]


def test_steps_and_a_second_reward_are_nodes_of_their_own():
    policy, reward, judge, trainer = M("policy"), M("reward"), M("judge"), M("ppo_policy")

    @step
    def keep_informative_groups(batch):
        return batch

    def env_flow(batch):
        out = policy.forward_step(batch)
        judged = judge.score_step(out)
        return keep_informative_groups(reward.forward_step(out, judged))

    flow, modules, steps = trace(env_flow, "environment")
    assert calls(flow) == [("policy.forward_step", [BATCH]), ("judge.score_step", [0]),
                           ("reward.forward_step", [0, 1]), ("keep_informative_groups", [2])]
    assert flow.nodes[3].model is None and steps["keep_informative_groups"] is keep_informative_groups
    assert keep_informative_groups({"x": [1]}) == {"x": [1]}  # outside a trace it is the function
    engine = GRPOMathEngine(M("policy"), None, M("reward"), M("reward1"), M("ppo_policy"))
    assert [n.name for n in engine.compile(None)[0].evaluator.nodes] == [
        "policy.eval_forward", "reward1.score_step", "reward.eval_forward"]
    del trainer


@pytest.mark.parametrize("flow_body, message", [
    (lambda p, r: r.forward_step(p.forward_step(3)), "policy.forward_step got int"),
    (lambda p, r: p.forward_step(lambda: 1) if False else p.forward_step(), "policy.forward_step reads nothing"),
    (lambda p, r: r.forward_step(p.forward_step(None)), "reads nothing"),
    (lambda p, r: p.forward_step(p.forward_step(None)), "reads nothing"),
    (lambda p, r: p.forward_step(r.forward_step(p.forward_step)), "got function"),
    (lambda p, r: (p.forward_step(p.forward_step)), "got function"),
])
def test_a_flow_that_passes_anything_else_is_named(flow_body, message):
    policy, reward = M("policy"), M("reward")

    def env_flow(batch):
        return flow_body(policy, reward)

    with pytest.raises(FlowError, match=message):
        trace(env_flow, "environment")


def test_misuses_are_errors_naming_the_flow_and_the_call():
    policy, reward, trainer, other = M("policy"), M("reward"), M("ppo_policy"), M("value")

    def peeks(batch):
        out = policy.forward_step(batch)
        if out["response"]:  # an output has no value while traced
            return out
        return out

    def twice(batch):
        policy.forward_step(batch)
        return policy.forward_step(batch)

    def no_return(batch):
        reward.forward_step(policy.forward_step(batch))

    def env_flow(batch):
        return reward.forward_step(policy.forward_step(batch))

    def trains(batch):
        trainer.train_step(batch)

    def scores_in_trainer(batch):
        trainer.forward_step(batch)

    with pytest.raises(FlowError, match=r"compute flow .*peeks: item 'response' of a model call's output"):
        trace(peeks, "environment")
    with pytest.raises(FlowError, match=r"twice: policy.forward_step is called twice"):
        trace(twice, "environment")
    with pytest.raises(FlowError, match=r"no_return returns nothing: the environment's return value is the "
                                        "experience"):
        Engine(Environment(no_return), Trainer(trains))
    with pytest.raises(FlowError, match=r"scores_in_trainer: ppo_policy.forward_step; a trainer flow calls "
                                        "train_step"):
        Engine(Environment(env_flow), Trainer(scores_in_trainer))
    with pytest.raises(FlowError, match=r"set_parameter_sync\(value, policy\): value is never trained"):
        Engine(Environment(env_flow), Trainer(trains)).set_parameter_sync(other, policy)
    with pytest.raises(FlowError, match=r"set_parameter_sync\(ppo_policy, value\): value must be an inference "
                                        "model"):
        Engine(Environment(env_flow), Trainer(trains)).set_parameter_sync(trainer, other)
    with pytest.raises(FlowError, match="expected a Trainer or None, got Environment"):
        Engine(Environment(env_flow), Environment(env_flow))


def test_a_flow_calling_a_model_the_config_lacks_is_a_config_error(tmp_path):
    from chatlearn.config import ConfigError, EngineChecks

    policy, reward, judge, trainer = M("policy"), M("reward"), M("judge"), M("ppo_policy")

    def env_flow(batch):
        out = policy.forward_step(batch)
        return reward.forward_step(out, judge.score_step(out))

    def trainer_flow(batch):
        trainer.train_step(batch)

    engine = Engine(Environment(env_flow), Trainer(trainer_flow), name="custom").set_parameter_sync(trainer, policy)
    cfg = f"{REPO}/configs/default.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(cfg, [], [EngineChecks(engine.name, {}, engine.spec)])
    problems = str(err.value)
    assert "models: the custom engine needs models named ['policy', 'judge', 'reward', 'ppo_policy']; missing " \
        "['judge']" in problems
    # its trainer (a module of one's own) declares no advantage estimator: the reward making the experience
    # names one
    assert "models.reward.args_dict.advantage_estimator: reward makes the experience, but no model the custom " \
        "engine trains declares the advantage estimator it trains on (a module's default_advantage_estimator); " \
        "name one (e.g. gae, grpo)" in problems
    # the default config's value and ppo_value are models this engine does not use
    assert "models.value: the custom engine does not use a model named 'value'" in problems
    # no evaluator flow: the eval the default config asks for is refused, not skipped
    assert "runtime.eval_episode_interval: 2 evaluates every 2 episode(s), but the 'custom' engine has no " \
        "evaluator flow (a chatlearn.Evaluator) to run it; set it to 0" in problems
    assert "runtime.enable_eval_before_training: true evaluates before the first episode, but the 'custom' " \
        "engine has no evaluator flow (a chatlearn.Evaluator) to run it; set it to false" in problems


def test_the_rlhf_engine_built_in_code_and_from_the_config_are_one_plan():
    cfg = load_config(f"{REPO}/configs/default.yaml")
    from_config = resolve_engine(cfg)
    in_code = RLHFEngine(*[from_config.modules[n] for n in ("policy", "reference", "reward", "value", "ppo_policy",
                                                            "ppo_value")])
    assert in_code.resolve(cfg).plan == from_config.plan


def test_a_stages_calls_are_sent_in_the_flows_order_whatever_thread_gets_there_first():
    import threading
    import time

    from chatlearn.runtime.calls.turns import Turns
    from chatlearn.runtime.calls.waiting import StageClock
    from chatlearn.utils.errors import RunError

    clock, turns, sent = StageClock("score", 0, 30), Turns([1, 2, 3]), []

    def call(node, delay):
        time.sleep(delay)
        turns.wait(node, clock)
        sent.append(node)
        turns.release(node)

    threads = [threading.Thread(target=call, args=(n, d)) for n, d in ((3, 0.0), (2, 0.05), (1, 0.2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sent == [1, 2, 3]
    # a call that failed releases its turn; a stage that fails aborts the waiters with an error
    turns = Turns([1, 2])
    turns.abort()
    with pytest.raises(RunError, match="an earlier call of the flow failed"):
        turns.wait(2, clock)
    with pytest.raises(RunError, match="did not send its batches before the stage's deadline"):
        Turns([1, 2]).wait(2, StageClock("score", 0, 0.01))


def test_chatlearns_eval_engine_of_an_eval_flow_runs_that_flow():
    from chatlearn.runtime.engine import EvalEngine

    policy, reward, judge = M("policy"), M("reward"), M("judge")

    def eval_flow(batch):
        p = policy.forward_step(batch)
        return reward.eval_step(p), judge.eval_step(p)

    engine = EvalEngine(eval_flow)
    assert engine.own_flows and engine.spec().roles == ("policy", "reward", "judge")
    plan = engine.resolve(load_config(f"{REPO}/configs/default.yaml")).plan
    assert [n.name for n in plan.evaluator.nodes] == ["policy.forward_step", "reward.eval_step", "judge.eval_step"]
    assert plan.evaluator.outputs() == [1, 2] and plan.environment is None and plan.trainer is None
    # the built-in one, by its models
    assert not EvalEngine(M("policy"), M("reward")).own_flows
