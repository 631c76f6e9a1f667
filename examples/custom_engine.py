"""An engine of one's own, written as ChatLearn compute flows: GRPO with two rewards and a filter step.

The answer reward (the digit's closeness) adds the format reward's scores (is the response one digit?) to its
own, weighted by its ``reward_weights``, before it makes the group advantages; a step then drops the prompt
groups whose responses all scored the same (their advantages are all zero: nothing to learn from them).
``chatlearn train examples/custom_engine.yaml`` runs it; every call below is a task run in the Prefect UI.
"""

import torch

from chatlearn import Engine, Environment, Evaluator, Trainer, step


@step
def drop_uniform_groups(batch: dict) -> dict:
    """Keep the samples of the prompt groups whose scores differ; a group that all scored the same has zero
    advantages everywhere."""
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(batch["group_id"]):
        groups.setdefault(g, []).append(i)
    keep = [i for rows in groups.values() if len({float(batch["scores"][j]) for j in rows}) > 1 for i in rows]
    index = torch.tensor(keep, dtype=torch.long)
    return {k: v.index_select(0, index) if isinstance(v, torch.Tensor) else [v[i] for i in keep]
            for k, v in batch.items()}


class CustomEngine(Engine):
    def __init__(self, policy, reference, answer, format, ppo_policy):  # noqa: A002  # the model's name
        def env_flow(batch):
            policy_out = policy.forward_step(batch)
            ref_out = reference.forward_step(policy_out)
            format_out = format.score_step(policy_out)
            reward_out = answer.forward_step(policy_out, ref_out, format_out)
            return drop_uniform_groups(reward_out)

        def trainer_flow(batch):
            ppo_policy.train_step(batch)

        def eval_flow(batch):
            policy_out = policy.eval_forward(batch)
            format_out = format.score_step(policy_out)
            return answer.eval_forward(policy_out, format_out)

        super().__init__(Environment(env_flow), Trainer(trainer_flow), Evaluator(eval_flow))
        self.set_parameter_sync(ppo_policy, policy)
