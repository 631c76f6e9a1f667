"""Engines: which models an algorithm uses and which method of which model feeds which.

As in ChatLearn, an engine is just its models plus the wiring; users write `forward_step`/`train_step` and
never see scheduling. Unlike ChatLearn, the wiring is an explicit `EpisodePlan` (no parsing of a flow
function's source), and `flows/episode.py` turns it into Prefect tasks.
"""

from typing import Any

from pydantic import BaseModel, Field

from chatlearn.models import DEFAULT_MODULES
from chatlearn.models.base_module import BaseModule
from chatlearn.utils.arguments import ChatLearnConfig, ConfigError


class EpisodePlan(BaseModel):
    """The DAG of one episode, by model name."""

    producer: str = Field(description="generates rollouts from prompt batches (owns the dataset)")
    scorers: list[str] = Field(default_factory=list, description="run on the rollouts, in parallel")
    final: str | None = Field(None, description="gets rollouts + scorer outputs; its output is the experience")
    trainers: list[str] = Field(default_factory=list, description="train on the experience")
    sync: list[tuple[str, str]] = Field(default_factory=list, description="(trainer, inference) weight pairs")
    evaluator: str | None = Field(None, description="scores the producer's eval outputs")
    export: str | None = Field(None, description="trainable model saved as the final policy")


class Engine:
    """Models + plan; `learn()` runs the Prefect train flow on Ray."""

    name = "engine"

    def __init__(self, modules: dict[str, BaseModule], plan: EpisodePlan):
        self.modules = modules
        self.plan = plan

    def learn(self, config: ChatLearnConfig | str | None = None, overrides: list[str] | None = None) -> dict:
        """Train with `config` (a config object, a YAML path, or the one given to `chatlearn.init`)."""
        from chatlearn import get_config
        from flows.train import train_flow

        if config is None:
            config = get_config()
        elif isinstance(config, str):
            from chatlearn.utils.config_loader import load_config

            config = load_config(config, overrides or [])
        return train_flow(config, modules=self.modules, engine=self.name)


class RLHFEngine(Engine):
    """PPO: policy → (reference, value) → reward; ppo_policy and ppo_value train; both synced back."""

    name = "rlhf"

    def __init__(self, policy: BaseModule, reference: BaseModule, reward: BaseModule, value: BaseModule,
                 ppo_policy: BaseModule, ppo_value: BaseModule):
        modules = {m.name: m for m in (policy, reference, reward, value, ppo_policy, ppo_value)}
        plan = EpisodePlan(
            producer=policy.name,
            scorers=[reference.name, value.name],
            final=reward.name,
            trainers=[ppo_policy.name, ppo_value.name],
            sync=[(ppo_policy.name, policy.name), (ppo_value.name, value.name)],
            evaluator=reward.name,
            export=ppo_policy.name,
        )
        super().__init__(modules, plan)


class EvalEngine(Engine):
    """Evaluation alone: the policy answers the eval set, the reward scores it (ChatLearn's EvalEngine)."""

    name = "eval"

    def __init__(self, policy: BaseModule, reward: BaseModule):
        plan = EpisodePlan(producer=policy.name, evaluator=reward.name)
        super().__init__({m.name: m for m in (policy, reward)}, plan)

    def learn(self, config: ChatLearnConfig | str | None = None, overrides: list[str] | None = None) -> dict:
        return self.eval(config, overrides)

    def eval(self, config: ChatLearnConfig | str | None = None, overrides: list[str] | None = None) -> dict:
        """Score the eval set once; returns the eval metrics."""
        from chatlearn import get_config
        from flows.evaluate import eval_flow

        if config is None:
            config = get_config()
        elif isinstance(config, str):
            config = load_run_config(config, overrides or [], self.modules)
        return eval_flow(config, modules=self.modules)


ENGINES: dict[str, type[Engine]] = {"rlhf": RLHFEngine, "eval": EvalEngine}
ENGINE_ROLES: dict[str, list[str]] = {
    "rlhf": ["policy", "reference", "reward", "value", "ppo_policy", "ppo_value"],
    "eval": ["policy", "reward"],
}


def module_class_path(name: str, cfg: ChatLearnConfig) -> str | None:
    args = cfg.models[name].args_dict or {}
    return args.get("module") or DEFAULT_MODULES.get(name)


def check_module_args(cfg: ChatLearnConfig, modules: dict[str, BaseModule] | None = None,
                      skip_unknown: bool = False) -> list[str]:
    """Problems with each model's `args_dict` against its module's `args_schema`, as dotted paths.

    With `skip_unknown`, models with no module to check against are left alone (`build_engine` reports them).
    """
    from chatlearn.utils.imports import import_object

    problems: list[str] = []
    for name in cfg.models:
        if modules is not None and name in modules:
            cls: Any = type(modules[name])
        else:
            spec = module_class_path(name, cfg)
            if spec is None:
                if skip_unknown:
                    continue
                problems.append(f"models.{name}.args_dict.module: no built-in module for a model named "
                                f"{name!r}; set args_dict.module to 'package.module:Class'")
                continue
            try:
                cls = import_object(spec, "Class")
            except ValueError as exc:
                problems.append(f"models.{name}.args_dict.module: {exc}")
                continue
        schema = getattr(cls, "args_schema", None)
        if schema is None:
            continue
        from pydantic import ValidationError

        try:
            schema.model_validate(cfg.models[name].args_dict or {})
        except ValidationError as exc:
            for err in exc.errors():
                loc = ".".join(str(x) for x in err["loc"])
                problems.append(f"models.{name}.args_dict.{loc}: {err['msg']}")
    return problems


def check_hooks(cfg: ChatLearnConfig) -> list[str]:
    """Hooks named in the config must import; relay on needs its hook (ChatLearn raises too)."""
    from chatlearn.data.relay import load_hook

    rt = cfg.runtime
    hook = rt.get("relay_sample_fn")
    problems = []
    if rt.max_relay_episode < -1:
        problems.append(f"runtime.max_relay_episode: must be -1 (all), 0 (off) or N > 0, got {rt.max_relay_episode}")
    if rt.max_relay_episode != 0 and not hook:
        problems.append(f"runtime.relay_sample_fn: max_relay_episode={rt.max_relay_episode} turns relay on, which "
                        "needs a hook 'package.module:function' that builds each episode's training samples from "
                        "the kept episodes (e.g. chatlearn.data.relay:concat_all)")
    for key in ("relay_sample_fn", "eval_post_process_fn"):
        spec = rt.get(key)
        if spec:
            try:
                load_hook(spec)
            except ValueError as exc:
                problems.append(f"runtime.{key}: {exc}")
    return problems


def check_layout(cfg: ChatLearnConfig) -> list[str]:
    """Layouts the runtime cannot run yet, said plainly instead of silently idling processes.

    A replica of several processes needs the module to shard itself (data/tensor/pipeline parallel over
    torch.distributed); the built-in modules do not yet, so each replica must be one process.
    """
    from chatlearn.runtime.model_group import replica_layout

    problems = []
    for name, m in cfg.models.items():
        if m.num_gpu == 0 and m.num_cpu == 0:
            continue  # reported by the generic checks
        replicas, procs, _ = replica_layout(m)
        if procs > 1:
            unit, per = ("num_gpu", "gpu_per_process") if m.num_gpu else ("num_cpu", "cpu_per_process")
            problems.append(
                f"models.{name}.{unit}: {getattr(m, unit)} with {per}={getattr(m, per)} gives {procs} processes "
                f"per replica ({replicas} replica(s)); multi-process replicas (data/tensor/pipeline parallel) "
                f"are not supported yet: set {per} to {unit} / replicas, or use more replicas"
            )
    return problems


def load_run_config(config: "ChatLearnConfig | dict | str", overrides: list[str] | None = None,
                    modules: dict[str, BaseModule] | None = None) -> ChatLearnConfig:
    """Load a config for training: the generic checks and the modules' `args_dict` checks in ONE error."""
    from chatlearn.utils.arguments import EXTRA_VALIDATORS
    from chatlearn.utils.config_loader import load_config, load_config_dict

    def module_args(cfg: ChatLearnConfig) -> list[str]:
        return check_module_args(cfg, modules, skip_unknown=True) + check_layout(cfg) + check_hooks(cfg)

    EXTRA_VALIDATORS.append(module_args)
    try:
        if isinstance(config, ChatLearnConfig) and not overrides:
            # already validated when it was built; only the run-specific checks are left
            problems = module_args(config)
            if problems:
                raise ConfigError(problems)
            return config
        if isinstance(config, ChatLearnConfig):
            return load_config_dict(config.model_dump(mode="json"), None, overrides)
        if isinstance(config, dict):
            return load_config_dict(config, None, overrides or [])
        return load_config(config, overrides or [])
    finally:
        EXTRA_VALIDATORS.remove(module_args)


def build_engine(cfg: ChatLearnConfig, modules: dict[str, BaseModule] | None = None,
                 engine: str | None = None) -> Engine:
    """The engine a config asks for (`runtime.engine`, default `rlhf`), with modules built from the config.

    Raises `ConfigError` listing every problem (unknown engine, missing models, bad module args).
    """
    from chatlearn.utils.imports import import_object

    engine_name = engine or cfg.runtime.get("engine") or "rlhf"
    problems: list[str] = []
    if engine_name not in ENGINES:
        raise ConfigError([f"runtime.engine: unknown engine {engine_name!r}; known: {sorted(ENGINES)}"])
    roles = ENGINE_ROLES[engine_name]
    missing = [r for r in roles if r not in cfg.models and not (modules and r in modules)]
    if missing:
        problems.append(f"models: the {engine_name} engine needs models named {roles}; missing {missing}")
    problems += check_module_args(cfg, modules)
    if problems:
        raise ConfigError(problems)
    if modules is None:
        modules = {name: import_object(module_class_path(name, cfg))(name) for name in roles}
    return ENGINES[engine_name](*[modules[r] for r in roles])
