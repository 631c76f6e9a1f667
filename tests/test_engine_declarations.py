"""Each engine is declared once, in its class (its models, flows, syncs, module classes), and the config checks,
resolving and ChatLearn's engine classes all read that; an engine of one's own goes through the same path and
gets the checks a built-in of its shape gets (no Ray, no Prefect)."""

import os
import sys
import textwrap

import pytest
import yaml

import chatlearn
from chatlearn.config import ConfigError, EngineChecks, load_config
from chatlearn.config.engines import engine_class
from chatlearn.models.base_module import BaseModule
from chatlearn.models.hf.grpo_trainer import GRPOPolicyTrainer
from chatlearn.models.hf.policy import PolicyInference
from chatlearn.models.hf.reference import ReferenceModel
from chatlearn.models.hf.reward import RuleReward
from chatlearn.runtime import engine as faces
from chatlearn.runtime import engines
from chatlearn.runtime.engines import BUILT_IN, resolve_engine
from tests.conftest import REPO

GRPO_YAML = os.path.join(REPO, "configs", "grpo.yaml")
NO_EVAL = ["runtime.eval_episode_interval=0", "runtime.enable_eval_before_training=false"]


def problems(config, overrides=(), checks=None):
    try:
        load_config(config, list(overrides), [checks or EngineChecks()])
        return []
    except ConfigError as exc:
        return exc.problems


def test_a_built_in_engine_is_one_class_read_by_the_checks_resolve_and_chatlearns_api():
    # the registry is the classes by their own names; ChatLearn's engine classes are those classes
    assert {name: cls.__name__ for name, cls in BUILT_IN.items()} == {
        "rlhf": "RLHF", "grpo": "GRPO", "grpo_math": "GRPOMath", "dpo": "DPO", "online_dpo": "OnlineDPO",
        "eval": "Evaluation"}
    for face in (faces.RLHFEngine, faces.GRPOEngine, faces.GRPOMathEngine, faces.DPOEngine, faces.OnlineDPOEngine,
                 faces.EvalEngine):
        assert BUILT_IN[face.name] in face.__mro__ and "__init__" not in vars(face)
        assert engine_class(face.name) is BUILT_IN[face.name]
    # what the checks read is what the class's flows do: rlhf's syncs are written once, in its constructor
    rlhf = engines.RLHF.declared()
    assert rlhf.roles == ("policy", "reference", "reward", "value", "ppo_policy", "ppo_value")
    assert rlhf.sync == (("ppo_policy", "policy"), ("ppo_value", "value"))
    assert (rlhf.producer, rlhf.trainers, rlhf.advantage_estimator) == ("policy", ("ppo_policy", "ppo_value"), "gae")
    # the defaults come from the trainers' module classes, which the engine's module_classes name
    grpo = engines.GRPO.declared()
    assert (grpo.advantage_estimator, grpo.groups, grpo.optional) == ("grpo", True, ("reference",))
    online = engines.OnlineDPO.declared()
    assert (online.advantage_estimator, online.pairs_in_groups, online.multi_turn) == ("grpo", True, False)
    dpo = engines.DPO.declared()
    assert (dpo.producer, dpo.sync, dpo.advantage_estimator) == ("reference", (), None)
    assert not engines.Evaluation.declared().trains
    # a flow that reads the config is traced for it: GRPO's old log-probs from the trainer's forward pass
    cfg = load_config(GRPO_YAML, ["models.ppo_policy.args_dict.old_logprobs=trainer"])
    assert ("ppo_policy", "forward_step") in engines.GRPO.declared(cfg).scorers
    assert ("ppo_policy", "forward_step") not in engines.GRPO.declared().scorers


def test_resolving_builds_the_declared_modules_and_tells_the_reward_its_trainers_estimator():
    for config, estimator in (("default", "gae"), ("grpo", "grpo"), ("online_dpo", "grpo")):
        resolved = resolve_engine(load_config(os.path.join(REPO, "configs", f"{config}.yaml")))
        cls = BUILT_IN[resolved.name]
        assert list(resolved.modules) == [r for r in cls.model_roles() if r in resolved.modules]
        for name, module in resolved.modules.items():
            path = cls.module_classes[name]
            assert f"{type(module).__module__}:{type(module).__name__}" == path, (config, name)
        assert resolved.modules["reward"].engine_estimator == estimator


OWN_ENGINE = '''
    """An engine of one's own in ChatLearn's documented style, on GRPO's models: an environment and a trainer
    flow, no evaluator."""
    import chatlearn


    class MyGRPO(chatlearn.Engine):
        def __init__(self, policy, reference, reward, ppo_policy):
            def env_flow(batch):
                policy_out = policy.forward_step(batch)
                ref_out = reference.forward_step(policy_out)
                return reward.forward_step(policy_out, ref_out)

            def trainer_flow(batch):
                ppo_policy.train_step(batch)

            super().__init__(chatlearn.Environment(env_flow), chatlearn.Trainer(trainer_flow))
            self.set_parameter_sync(ppo_policy, policy)
'''


@pytest.fixture
def own_engine(tmp_path, monkeypatch):
    """A project outside the repository: the engine next to a config that includes the packaged grpo.yaml."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "mine.py").write_text(textwrap.dedent(OWN_ENGINE))
    (project / "run.yaml").write_text(
        "includes: [grpo.yaml]\nruntime:\n  engine: mine.py:MyGRPO\n"
        "models:\n  ppo_policy:\n    args_dict:\n      module: chatlearn.models.hf.grpo_trainer:GRPOPolicyTrainer\n")
    monkeypatch.chdir(tmp_path)
    path = list(sys.path)
    yield str(project / "run.yaml")
    sys.path[:] = path  # the import of mine.py put its folder there: the next test's mine.py is another file
    sys.modules.pop("mine", None)


def test_an_engine_of_ones_own_named_by_the_config_gets_grpos_checks(own_engine):
    # its trainer's module says the estimator (GRPO's): no "no default advantage estimator"; the eval the
    # included config asks for has no evaluator flow to run it: refused before anything starts, one line each
    assert problems(own_engine) == [
        "runtime.eval_episode_interval: 2 evaluates every 2 episode(s), but the 'mine.py:MyGRPO' engine has no "
        "evaluator flow (a chatlearn.Evaluator) to run it; set it to 0",
        "runtime.enable_eval_before_training: true evaluates before the first episode, but the 'mine.py:MyGRPO' "
        "engine has no evaluator flow (a chatlearn.Evaluator) to run it; set it to false"]
    assert problems(own_engine, NO_EVAL) == []
    # the checks a built-in GRPO gets, as GRPO gets them
    for change in (["models.policy.args_dict.num_inference_per_prompt=1"], ["models.policy.sync_frequency=2"],
                   ["models.reward.args_dict.advantage_estimator=gae"],
                   ["runtime.dynamic_sampling=true", "runtime.stream_data_loader_type=static"]):
        ours = problems(own_engine, [*NO_EVAL, *change])
        theirs = problems(GRPO_YAML, [*NO_EVAL, *change])
        assert ours and ours == [p.replace("grpo engine", "mine.py:MyGRPO engine") for p in theirs], change
    # its flow never asks the trainer for log-probs: old_logprobs: trainer would silently be the sampler's
    assert problems(own_engine, [*NO_EVAL, "models.ppo_policy.args_dict.old_logprobs=trainer"]) == [
        "models.ppo_policy.args_dict.old_logprobs: trainer takes the old log-probs from ppo_policy's own forward "
        "pass, but the mine.py:MyGRPO engine's environment flow never calls ppo_policy.forward_step (they would be "
        "the sampler's); use generation or current"]
    # resolved the same way as a built-in: its modules and the estimator its reward runs
    resolved = resolve_engine(load_config(own_engine, NO_EVAL, [EngineChecks()]))
    assert resolved.name == "mine.py:MyGRPO" and list(resolved.modules) == ["policy", "reference", "reward",
                                                                              "ppo_policy"]
    assert resolved.modules["reward"].engine_estimator == "grpo" and resolved.plan.evaluator is None


def test_an_engine_of_ones_own_given_in_code_gets_its_estimator_from_its_trainer():
    """ChatLearn's documented style: modules built in code, `Engine(Environment(...), Trainer(...))`, the
    config naming runtime.engine: grpo (the issue's reproduction: refused with "the engine engine has no default
    advantage estimator", then, with one named, an AttributeError in the eval before training)."""
    policy, reference = PolicyInference("policy"), ReferenceModel("reference")
    reward, ppo_policy = RuleReward("reward"), GRPOPolicyTrainer("ppo_policy")

    def env_flow(batch):
        policy_out = policy.forward_step(batch)
        return reward.forward_step(policy_out, reference.forward_step(policy_out))

    def trainer_flow(batch):
        ppo_policy.train_step(batch)

    engine = chatlearn.Engine(chatlearn.Environment(env_flow), chatlearn.Trainer(trainer_flow))
    engine.set_parameter_sync(ppo_policy, policy)
    checks = EngineChecks(engine.name, engine.modules, engine.spec)
    assert [p.split(":")[0] for p in problems(GRPO_YAML, (), checks)] == [
        "runtime.eval_episode_interval", "runtime.enable_eval_before_training"]
    assert problems(GRPO_YAML, NO_EVAL, checks) == []
    engine.resolve(load_config(GRPO_YAML, NO_EVAL))
    assert reward.engine_estimator == "grpo"
    # a trainer of one's own that declares no estimator: the reward names one, said before anything starts
    own_trainer = OwnTrainer("ppo_policy")

    def own_trainer_flow(batch):
        own_trainer.train_step(batch)

    mine = chatlearn.Engine(chatlearn.Environment(env_flow), chatlearn.Trainer(own_trainer_flow), name="mine")
    mine.set_parameter_sync(own_trainer, policy)
    assert problems(GRPO_YAML, NO_EVAL, EngineChecks(mine.name, mine.modules, mine.spec)) == [
        "models.reward.args_dict.advantage_estimator: reward makes the experience, but no model the mine engine "
        "trains declares the advantage estimator it trains on (a module's default_advantage_estimator); name one "
        "(e.g. gae, grpo)"]
    assert problems(GRPO_YAML, [*NO_EVAL, "models.reward.args_dict.advantage_estimator=grpo"],
                    EngineChecks(mine.name, mine.modules, mine.spec)) == []


class OwnTrainer(BaseModule):
    """A trainer module of one's own: it declares nothing of what it reads."""


def test_a_flow_that_cannot_feed_what_the_config_asks_is_refused(own_engine):
    # an environment that only generates: the GRPO trainer would find no advantages at its first step
    with open(os.path.join(os.path.dirname(own_engine), "mine.py"), "a") as f:
        f.write(textwrap.dedent('''

            class Unscored(chatlearn.Engine):
                def __init__(self, policy, ppo_policy):
                    def env_flow(batch):
                        return policy.forward_step(batch)

                    def trainer_flow(batch):
                        ppo_policy.train_step(batch)

                    super().__init__(chatlearn.Environment(env_flow), chatlearn.Trainer(trainer_flow))
                    self.set_parameter_sync(ppo_policy, policy)
        '''))
    raw = yaml.safe_load(open(GRPO_YAML))
    del raw["models"]["reference"], raw["models"]["reward"]
    for model in raw["models"].values():
        model["model_config_file"] = os.path.join(REPO, "configs", model["model_config_file"])
    raw["models"]["ppo_policy"]["args_dict"].update(kl_coef=0.0, module=BUILT_IN["grpo"].module_classes["ppo_policy"])
    raw["runtime"].update(engine="mine.py:Unscored", colocation=["policy,ppo_policy"],
                          data_path=os.path.join(REPO, "configs", "data", "max_digit_train.jsonl"))
    unscored = os.path.join(os.path.dirname(own_engine), "unscored.yaml")
    with open(unscored, "w") as f:
        yaml.safe_dump(raw, f)
    assert problems(unscored, NO_EVAL) == [
        "runtime.engine: the mine.py:Unscored engine trains ['ppo_policy'] on advantages ('grpo' by default), but "
        "its environment flow makes none: after generation it calls no model's forward_step (a reward's makes "
        "them)"]
    # GRPOMath's flow scores with two rewards and never runs the trainer's forward pass
    assert problems(os.path.join(REPO, "configs", "grpo_math.yaml"),
                    ["models.ppo_policy.args_dict.old_logprobs=trainer"]) == [
        "models.ppo_policy.args_dict.old_logprobs: trainer takes the old log-probs from ppo_policy's own forward "
        "pass, but the grpo_math engine's environment flow never calls ppo_policy.forward_step (they would be the "
        "sampler's); use generation or current"]
    assert problems(GRPO_YAML, ["models.ppo_policy.args_dict.old_logprobs=trainer"]) == []
