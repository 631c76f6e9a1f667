"""ChatLearn's documented custom flow ("Use Engine directly to construct a custom process", docs/en/tutorial/
custom_model_flow.md of ChatLearn 1.0.2), its body as the docs write it; the module classes and the prompts are
the caller's (tests/test_compute_flow.py traces it, tests/test_train_flow.py runs it)."""

from chatlearn import Engine, Environment, Evaluator, Trainer


def documented_engine(PolicyInference, ValueInference, PolicyReference, RewardInference,  # noqa: N803
                      PolicyTrainer, ValueTrainer, train_prompts, val_prompts):
    policy = PolicyInference("policy")
    value = ValueInference("value")
    reference = PolicyReference("reference")
    reward = RewardInference("reward")
    ppo_policy = PolicyTrainer("ppo_policy")
    ppo_value = ValueTrainer("ppo_value")
    def env_flow(batch):
        policy_out = policy.forward_step(batch)
        ref_out = reference.forward_step(policy_out)
        value_out = value.forward_step(policy_out)
        reward_out = reward.forward_step(policy_out, ref_out, value_out)
        return reward_out
    def trainer_flow(batch):
        ppo_policy.train_step(batch)
        ppo_value.train_step(batch)
    def eval_flow(batch):
        r0 = policy.eval_step(batch)
        r1 = reward.eval_step(r0)
        return r1
    env = Environment(env_flow)
    trainer = Trainer(trainer_flow)
    evaluator = Evaluator(eval_flow).set_dataset(val_prompts)
    engine = Engine(env, trainer, evaluator) \
             .set_parameter_sync(ppo_policy, policy) \
             .set_parameter_sync(ppo_value, value) \
             .set_dataset(train_prompts)
    return engine
