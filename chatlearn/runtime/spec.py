"""What the driver reads from the config for one run: a frozen, JSON-serializable `RunSpec`, built in one place.

`RunSpec.of` is the only code that turns the checked config and the engine's plan into what the episodes read:
the config's own ``runtime`` section (``spec.runtime.sample_per_episode``: nothing copied field by field) and
the few values derived from the models' settings (the producer's batch size and group size, the rule rewards,
the agent's turn limits, which models checkpoint, the rollout strategy's name). The stage tasks, the rollout and
the train loop read the spec, never the config object.

What lives while the run lives (actor handles, weight versions, responses in flight) is not here: that is the
`RunContext` (:mod:`chatlearn.runtime.context`), which holds this spec.
"""

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from chatlearn.checkpoint.resume import models_to_checkpoint
from chatlearn.config import ChatLearnConfig, RuntimeConfig
from chatlearn.config.engine_checks import group_size, max_new_tokens
from chatlearn.envs.turns import TurnSpec
from chatlearn.models.rule import RuleSpec
from chatlearn.runtime.plan import EpisodePlan, ResolvedEngine

__all__ = ["RunSpec", "rollout_mode"]


def rollout_mode(rt: RuntimeConfig) -> str:
    """The rollout strategy a run's config asks for, by its registered name (`chatlearn.runtime.rollout`)."""
    if rt.task_type == "agent":
        return "multi_turn"
    if rt.use_partial_rollout:
        return "partial"
    return "single_turn"


class RunSpec(BaseModel):
    """One run as the driver reads it (see the module's doc)."""

    model_config = ConfigDict(frozen=True)

    runtime: RuntimeConfig = Field(description="the config's runtime section, as checked")
    engine: str = Field(description="the engine that runs (runtime.engine, or the one built in code)")
    plan: EpisodePlan
    data_checkpoint_path: str = Field("", description="where data checkpoint records and their payloads go")
    generation_batch_size: int = Field(description="the producer's generation batch size")
    group_size: int = Field(1, description="responses per prompt (the producer's num_inference_per_prompt)")
    sync_frequency: dict[str, int] = Field(default_factory=dict, description="per model receiving weights")
    checkpoint_models: list[str] = Field(default_factory=list, description="models that save checkpoints")
    rule_rewards: dict[str, RuleSpec] = Field(default_factory=dict, description="rule rewards scored one Prefect "
                                              "task per batch on Ray (flows/rule_tasks.py)")
    agent: TurnSpec | None = Field(None, description="task_type: agent: the environment and the turn limits")
    rollout: str = Field("single_turn", description="the rollout strategy (chatlearn.runtime.rollout)")
    rollout_round_budgets: list[int] = Field(default_factory=list, description="partial rollouts: the new "
                                             "tokens of each round")

    @classmethod
    def of(cls, cfg: ChatLearnConfig, eng: ResolvedEngine, data_checkpoint_path: str = "") -> "RunSpec":
        """The spec of a prepared run (`chatlearn.runtime.prepared.PreparedRun`'s config and engine)."""
        rt, plan = cfg.runtime, eng.plan
        producer = cfg.models[plan.producer]
        budgets = (rt.partial_rollout_manager_config.round_budgets(max_new_tokens(cfg, plan.producer))
                   if rt.use_partial_rollout else [])
        return cls(
            runtime=rt.model_copy(deep=True), engine=eng.name, plan=plan,
            data_checkpoint_path=data_checkpoint_path,
            generation_batch_size=producer.generation_batch_size or rt.generation_batch_size,
            group_size=group_size(cfg, plan.producer),
            sync_frequency={dst: cfg.models[dst].sync_frequency for _, dst in plan.sync},
            checkpoint_models=models_to_checkpoint(cfg, plan.trainers, plan.sync) if plan.trainers else [],
            rule_rewards=_rule_rewards(cfg, eng), agent=_turn_spec(cfg, eng) if rt.task_type == "agent" else None,
            rollout=rollout_mode(rt), rollout_round_budgets=budgets,
        )

    @property
    def namespace(self) -> str:
        """The run's Ray namespace (its actors' names are unique within it)."""
        return f"chatlearn-{self.runtime.exp_name}".replace(" ", "_")

    @property
    def sampling_rounds(self) -> int:
        """The most generation rounds of an episode: ``max_sampling_rounds`` with dynamic sampling, else 1."""
        return self.runtime.max_sampling_rounds if self.runtime.dynamic_sampling else 1


def _turn_spec(cfg: ChatLearnConfig, eng: ResolvedEngine) -> TurnSpec:
    """``runtime.agent`` with what an environment step needs of the policy (its answer length, its tokenizer)."""
    agent, name = cfg.runtime.agent, eng.plan.producer
    args = type(eng.modules[name]).args_schema.model_validate(cfg.models[name].args_dict or {})
    return TurnSpec(env=agent.env, env_args=agent.env_args, max_turns=agent.max_turns,
                    max_total_tokens=agent.max_total_tokens, max_new_tokens=args.max_new_tokens,
                    seed=cfg.runtime.seed, model_path=str(args.model_path),
                    num_cpus=agent.num_cpus_per_task, timeout_s=agent.timeout_s, retries=agent.retries)


def _rule_rewards(cfg: ChatLearnConfig, eng: ResolvedEngine) -> dict[str, RuleSpec]:
    """The rule rewards (``RuleReward`` modules with ``fan_out``, the default) the environment or evaluator flow
    calls: each batch they score is a Prefect task on Ray (``flows/rule_tasks.py``) before their model's call."""
    from chatlearn.models.hf.reward import RuleReward  # torch-heavy: loaded when a run is launched, not on import

    out: dict[str, Any] = {}
    for name, module in eng.modules.items():
        if isinstance(module, RuleReward) and eng.plan.calls(name, "forward_step", "eval_step", "eval_forward",
                                                             "score_step"):
            args = RuleReward.args_schema.model_validate(cfg.models[name].args_dict or {})
            if args.fan_out:
                out[name] = RuleSpec.of(args)
    return out
