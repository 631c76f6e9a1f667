"""The rule reward of a multi-turn task whose environment scores the conversation itself."""


def env_reward(sample: dict) -> float:
    """The sum of the rewards the sample's environment returned over its turns (``env_reward``, set by
    `chatlearn.envs.turns`): ``models.reward.args_dict.reward_fn: chatlearn.envs.rewards:env_reward``."""
    return float(sample["env_reward"])
