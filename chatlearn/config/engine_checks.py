"""The checks that need an engine: which models it uses, their modules' ``args_dict``, the hooks a config
names, the layouts the runtime cannot run yet, and the fields that are not implemented yet.

They run when an engine is built (``chatlearn train``, ``chatlearn eval``, ``engine.learn()``, and
``chatlearn config --check``), in the same pass as the config's own validation, so one error lists every
problem. Plain ``chatlearn config`` does not run them: it resolves any config ChatLearn's loader accepts.
"""

import contextlib
import inspect
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from chatlearn.config.engines import DEFAULT_MODULES, EngineSpec, engine_class
from chatlearn.config.errors import ConfigError, ConfigWarning, did_you_mean
from chatlearn.config.model import PARALLEL_KEYS
from chatlearn.config.root import ChatLearnConfig
from chatlearn.config.support import unsupported_values
from chatlearn.config.user_code import user_code
from chatlearn.utils.imports import import_callable, import_class, import_object

__all__ = ["EngineChecks", "engine_name", "group_size", "module_class_path"]


def engine_name(cfg: ChatLearnConfig, engine: str | None = None) -> str:
    """The engine to build: the one asked for in code, else ``runtime.engine``."""
    return engine or cfg.runtime.engine


def module_class_path(name: str, cfg: ChatLearnConfig, engine: str | Mapping[str, str] | None = None) -> str | None:
    """``args_dict.module`` of a model, else the module its engine runs for that name (None if none). ``engine``
    is the engine's name (default ``runtime.engine``), or its class's ``module_classes``."""
    args = cfg.models[name].args_dict if name in cfg.models else {}
    return args.get("module") or _engine_modules(engine if engine is not None else cfg.runtime.engine).get(name)


def _engine_modules(engine: str | Mapping[str, str]) -> Mapping[str, str]:
    """The modules an engine runs by model name (an engine built in code under no importable name: the defaults
    of the names)."""
    if not isinstance(engine, str):
        return engine
    try:
        return engine_class(engine).module_classes
    except ConfigError:
        return DEFAULT_MODULES


@dataclass
class EngineChecks:
    """Everything an engine needs of a config (a :class:`~chatlearn.config.root.ConfigCheck`).

    ``modules`` are the module objects given in code (``RLHFEngine(policy, ...)``), by model name; the
    others are checked against the module their config names.
    """

    engine: str | None = None
    modules: Mapping[str, Any] = field(default_factory=dict)
    # an engine object built in code gives its own (`EngineFlows.spec`: its flows as traced for the config);
    # otherwise the class runtime.engine names declares it (`EngineFlows.declared`)
    spec: Callable[[ChatLearnConfig], EngineSpec] | None = None
    data_given: bool = False  # the engine was given its prompts in code (``set_dataset``)

    def __call__(self, cfg: ChatLearnConfig) -> list[str]:
        with _py_modules_importable(cfg), user_code(cfg):
            return self._problems(cfg)

    def _problems(self, cfg: ChatLearnConfig) -> list[str]:
        name = engine_name(cfg, self.engine)
        spec, problem = (self.spec(cfg), "") if self.spec is not None else _imported_spec(name, cfg, self.modules)
        if spec is None:
            return [problem]
        if self.data_given:
            spec = spec._replace(needs_train_data=False)
        roles = [r for r in spec.roles if r in cfg.models or r in self.modules]
        problems = _roles(name, spec, cfg, self.modules)
        problems += _data(name, spec, cfg)
        problems += _module_args(cfg, roles, self.modules, name)
        problems += _hooks(cfg)
        problems += _layout(cfg, [r for r in roles if r in cfg.models], self.modules, name)
        problems += _groups(cfg, name, spec, self.modules)
        problems += _evaluation(cfg, name, spec)
        problems += _lora(cfg, [r for r in roles if r in cfg.models], self.modules, name)
        problems += _packing(cfg, [r for r in roles if r in cfg.models], self.modules, name)
        problems += _old_logprobs(cfg, name, spec, self.modules)
        problems += _rollout_engine(cfg, [r for r in roles if r in cfg.models], self.modules, name)
        problems += _advantage_shape(cfg, name, spec, roles, self.modules)
        problems += _environment_args(cfg)
        problems += _reward_settings(cfg, name, spec, self.modules)
        problems += _advantage_estimator(cfg, name, spec, self.modules)
        problems += _sync_frequency(cfg, spec)
        problems += _pipelined(cfg, name, spec)
        problems += _partial_rollout(cfg, name, spec, self.modules)
        problems += _dynamic_sampling(cfg, name, spec, self.modules)
        problems += _agent(cfg, name, spec, self.modules)
        problems += unsupported_values(cfg, [r for r in roles if r in cfg.models])
        _warn_offload_without_colocation(cfg, [r for r in roles if r in cfg.models])
        return problems


def _imported_spec(name: str, cfg: ChatLearnConfig, modules: Mapping[str, Any]) -> tuple[EngineSpec | None, str]:
    """The spec of the engine class ``runtime.engine`` names (a built-in, or one's own by import path: one rule,
    `chatlearn.config.engines.engine_class`), as it declares it for this config and the models given in code;
    else the one-line problem."""
    try:
        return engine_class(name).declared(cfg, modules), ""
    except ConfigError as exc:  # an unknown engine, or a flow of one's own that cannot be traced (FlowError)
        return None, "; ".join(exc.problems)
    except Exception as exc:  # noqa: BLE001  # a constructor of one's own that fails on the config's models
        return None, f"runtime.engine: {name}({', '.join(cfg.models)}) raised {type(exc).__name__}: {exc}"


@contextlib.contextmanager
def _py_modules_importable(cfg: ChatLearnConfig) -> Iterator[None]:
    """While checking, what ``runtime_env.py_modules`` ships to the Ray workers is importable here too, so a
    hook or module that only the workers get (a package directory, or a .py file) is checked, not refused."""
    extra = [os.path.dirname(os.path.abspath(p)) for p in cfg.runtime_env.py_modules or [] if os.path.exists(p)]
    extra = [p for p in dict.fromkeys(extra) if p not in sys.path]
    sys.path[:0] = extra
    try:
        yield
    finally:
        for p in extra:
            if p in sys.path:
                sys.path.remove(p)


def _roles(name: str, spec: EngineSpec, cfg: ChatLearnConfig, modules: Mapping[str, Any]) -> list[str]:
    missing = [r for r in spec.roles if r not in cfg.models and r not in modules and r not in spec.optional]
    problems = []
    if missing:
        problems.append(f"models: the {name} engine needs models named {list(spec.roles)}; missing {missing}")
    extra = [m for m in cfg.models if m not in spec.roles]
    if extra and spec.trains:
        problems += [f"models.{m}: the {name} engine does not use a model named {m!r} (it uses "
                     f"{', '.join(spec.roles)}); remove it or rename it" for m in extra]
    return problems


def _data(name: str, spec: EngineSpec, cfg: ChatLearnConfig) -> list[str]:
    rt = cfg.runtime
    if spec.needs_train_data and not rt.data_path:
        return [f"runtime.data_path: the {name} engine needs a prompt file (JSONL or JSON)"]
    if not spec.trains and not rt.eval_data_path:
        return ["runtime.eval_data_path: evaluation needs an eval set (JSONL or JSON prompt file)"]
    return []


def _module_args(cfg: ChatLearnConfig, roles: list[str], modules: Mapping[str, Any], engine: str) -> list[str]:
    """Each model's ``args_dict`` against its module's ``args_schema``, as dotted paths."""
    problems: list[str] = []
    for name in roles:
        if name not in cfg.models:
            continue  # given in code only: it has no args_dict
        if name in modules:
            cls: Any = type(modules[name])
        else:
            spec = module_class_path(name, cfg, engine)
            if spec is None:
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
        args = cfg.models[name].args_dict or {}
        if _is_builtin(cls):
            problems += _unknown_args(name, cls, schema, args)
        try:
            schema.model_validate(args)
        except ValidationError as exc:
            for err in exc.errors(include_url=False):
                loc = ".".join([f"models.{name}.args_dict", *(str(x) for x in err["loc"])])
                msg = err["msg"].removeprefix("Value error, ")
                if err["type"] == "literal_error":  # a choice among names: the nearest one
                    msg += did_you_mean(err["input"], re.findall(r"'([^']*)'", err["ctx"]["expected"]))
                problems.append(f"{loc}: {msg}")
    return problems


def _unknown_args(name: str, cls: type, schema: Any, args: Mapping[Any, Any]) -> list[str]:
    """A built-in module knows every argument it reads (its ``args_schema``), so any other ``args_dict`` key is a
    misspelling (or another backend's key) that would silently leave the argument at its default: refused,
    with the nearest known name. ``module`` (which class to run) and the parallel sizes a model file may set
    (copied to the model's fields by the loader) are the config's, not the module's, and always allowed.
    A user's module keeps a free ``args_dict``: its schema, when it has one, decides."""
    fields = getattr(schema, "model_fields", {})
    known = {*fields, *(f.alias for f in fields.values() if getattr(f, "alias", None)), "module", *PARALLEL_KEYS}
    owner = getattr(schema, "__name__", "its args_schema")
    return [f"models.{name}.args_dict.{key}: unknown argument of {cls.__name__} (not in {owner})"
            f"{did_you_mean(key, known)}" for key in args if key not in known]


def _hooks(cfg: ChatLearnConfig) -> list[str]:
    """Hooks named in the config must import; relay on needs its hook (ChatLearn raises too)."""
    rt = cfg.runtime
    problems = []
    if rt.max_relay_episode != 0 and not rt.relay_sample_fn:
        problems.append(f"runtime.relay_sample_fn: max_relay_episode={rt.max_relay_episode} turns relay on, which "
                        "needs a hook 'package.module:function' that builds each episode's training samples from "
                        "the kept episodes (e.g. chatlearn.data.relay:concat_all)")
    for key in ("relay_sample_fn", "eval_post_process_fn"):
        spec = getattr(rt, key)
        if spec:
            try:
                import_callable(spec)
            except ValueError as exc:
                problems.append(f"runtime.{key}: {exc}")
    return problems


def _module_class(name: str, cfg: ChatLearnConfig, modules: Mapping[str, Any], engine: str | None = None) -> Any:
    """The module class a model runs (given in code, or named by the config); None if it does not import."""
    if name in modules:
        return type(modules[name])
    spec = module_class_path(name, cfg, engine)
    try:
        return import_object(spec, "Class") if spec else None
    except ValueError:
        return None  # reported by _module_args


def _layout(cfg: ChatLearnConfig, names: list[str], modules: Mapping[str, Any], engine: str) -> list[str]:
    """A replica of several processes needs a module that works with them (``multi_process = True``: it uses
    its ``process_group``/``parallel``). The built-in modules take data parallel and ZeRO for trainers and
    tensor parallel for every model (:mod:`chatlearn.models.parallel`); what they cannot do yet is refused
    here, naming the field, instead of silently idling processes."""
    problems = []
    for name in names:
        m = cfg.models[name]
        if m.num_gpu == 0 and m.num_cpu == 0:
            continue  # reported by the config's own checks
        layout = m.layout
        cls = _module_class(name, cfg, modules, engine)
        if layout.processes < 2 or cls is None:
            continue
        unit, per = ("num_gpu", "gpu_per_process") if m.num_gpu else ("num_cpu", "cpu_per_process")
        shape = (f"models.{name}.{unit}: {getattr(m, unit)} with {per}={getattr(m, per)} gives {layout.processes} "
                 f"processes per replica ({layout.replicas} replica(s))")
        if not getattr(cls, "multi_process", False):
            problems.append(
                f"{shape}, but {cls.__name__} runs a replica in one process (data/tensor/pipeline parallel is not "
                f"supported by it yet): set {per} to {unit} / replicas, use more replicas, or a module with "
                f"multi_process = True")
            continue
        if not _is_builtin(cls):
            continue  # a user's multi-process module decides what its processes do
        tp, pp, zero = m.tensor_model_parallel_size or 1, m.pipeline_model_parallel_size or 1, m.zero_size or 1
        if pp > 1 and not getattr(cls, "supports_pipeline", False):
            problems.append(f"models.{name}.pipeline_model_parallel_size: {pp}: {cls.__name__} does not run "
                            f"pipeline stages yet (the policy, reference and PPO/GRPO policy trainers do; use "
                            f"tensor_model_parallel_size or zero_size)")
        elif pp > 1 and layout.processes != pp:
            problems.append(f"{shape}, but pipeline parallel next to tensor/data parallel or ZeRO is not supported "
                            f"yet: a pipeline replica has pipeline_model_parallel_size = {pp} processes")
        elif layout.processes % (tp * zero):
            problems.append(f"{shape}, not a multiple of tensor_model_parallel_size * zero_size = {tp * zero}")
        elif not m.trainable and layout.processes != tp * pp:
            problems.append(
                f"{shape}, but an inference replica of {cls.__name__} splits only by tensor parallel "
                f"(tensor_model_parallel_size={tp}{', zero_size is for trainers' if zero > 1 else ''}): set "
                f"tensor_model_parallel_size to {layout.processes}, or {per} so that a replica is one process "
                f"(more replicas are data parallel)")
        elif m.lora.enable_lora:
            problems.append(f"models.{name}.lora.enable_lora: LoRA on a replica of several processes is not "
                            f"supported yet ({shape})")
    return problems


def _is_builtin(cls: type) -> bool:
    return cls.__module__.startswith("chatlearn.")


def _warn_offload_without_colocation(cfg: ChatLearnConfig, names: list[str]) -> None:
    """ChatLearn offloads only colocated models; the flags on a model alone on its devices do nothing."""
    grouped = {n for g in cfg.runtime.colocation_groups if len([m for m in g if m in names]) > 1 for n in g}
    for name in names:
        m = cfg.models[name]
        given = ["free_memory"] if m.free_memory else [
            k for k in ("offload_weights", "offload_optimizer_states", "free_grad_buffers") if getattr(m, k)]
        for key in given if name not in grouped else []:
            warnings.warn(f"models.{name}.{key}=True has no effect here: {name} is not in a colocation group "
                          "(ChatLearn offloads only colocated models)", ConfigWarning, stacklevel=2)


def _sync_frequency(cfg: ChatLearnConfig, spec: EngineSpec) -> list[str]:
    """A model that receives weights syncs every N >= 1 episodes, or never (0); others may hold anything."""
    problems = []
    for _, dst in spec.sync:
        if dst in cfg.models and cfg.models[dst].sync_frequency < 0:
            problems.append(f"models.{dst}.sync_frequency: must be >= 0 for a model that receives weights "
                            f"(0: never sync), got {cfg.models[dst].sync_frequency}")
    return problems


def _pipelined(cfg: ChatLearnConfig, engine: str, spec: EngineSpec) -> list[str]:
    """``runtime.max_staleness`` > 0 overlaps the generating model (the producer, receiving the trainer's
    weights) with scoring and training: it needs processes of its own and a sync every episode (its old
    log-probs: `_old_logprobs`)."""
    k, rt = cfg.runtime.max_staleness, cfg.runtime
    if k == 0:
        return []
    producer, src = _generator(cfg, spec)
    if src is None:
        return [f"runtime.max_staleness: {k}, but the {engine!r} engine does not generate with a copy of the model "
                f"it trains (a policy synced from ppo_policy): there is nothing to overlap; leave it at 0"]
    problems = [f"runtime.colocation: {producer!r} is colocated with {[m for m in group if m != producer]}, but "
                f"runtime.max_staleness: {k} runs its generation while {src!r} trains: it needs processes of its own "
                f"(take it out of the group, or set max_staleness: 0)"
                for group in rt.colocation_groups if producer in group and len(group) > 1]
    if cfg.models[producer].sync_frequency != 1:
        problems.append(f"models.{producer}.sync_frequency: {cfg.models[producer].sync_frequency} with runtime."
                        f"max_staleness: {k} is not supported yet (the pipeline syncs every episode); set it to 1")
    return problems


def _generator(cfg: ChatLearnConfig, spec: EngineSpec) -> tuple[str, str | None]:
    """The engine's producer and the trained model it is synced from, when the config has both (a generation on
    the trainer's weights: what pipelining, partial rollouts and agents continue); else (producer, None)."""
    producer = spec.producer or ""
    src = spec.synced_into(producer)
    return producer, src if src in cfg.models and producer in cfg.models else None


def _dynamic_sampling(cfg: ChatLearnConfig, engine: str, spec: EngineSpec, modules: Mapping[str, Any]) -> list[str]:
    """``runtime.dynamic_sampling`` drops the prompt groups whose responses all score the same: it needs prompt
    groups, an episode that trains however many it kept (``dynamic`` loader), and one episode's generation at a
    time (not pipelined, not partial rollouts: they are not supported together yet)."""
    rt = cfg.runtime
    if not rt.dynamic_sampling:
        # by value: a deployment's run form sends every field, defaults included
        if rt.max_sampling_rounds != type(rt).model_fields["max_sampling_rounds"].default:
            return ["runtime.max_sampling_rounds: only used with runtime.dynamic_sampling: true; remove it"]
        return []
    problems = []
    producer = spec.producer or "policy"
    if not (spec.groups or group_size(cfg, producer) > 1):
        problems.append("runtime.dynamic_sampling: drops prompt groups whose responses all score the same, but "
                        f"the {engine!r} engine samples one response per prompt; set models.{producer}.args_dict."
                        "num_inference_per_prompt to 2 or more, or dynamic_sampling to false")
    if not spec.trains or not spec.scorers:
        problems.append(f"runtime.dynamic_sampling: the {engine!r} engine scores no generated responses; set it to "
                        "false")
    if rt.stream_data_loader_type != "dynamic":
        problems.append(f"runtime.stream_data_loader_type: {rt.stream_data_loader_type!r} trains exactly "
                        "sample_per_episode samples, but with dynamic_sampling an episode whose rounds ran out trains "
                        "the groups it kept; set it to 'dynamic'")
    if rt.max_staleness > 0:
        problems.append("runtime.dynamic_sampling with runtime.max_staleness > 0 is not supported yet (a pipelined "
                        "episode's prompts are fixed before it generates); set one of them to its default")
    if rt.use_partial_rollout:
        problems.append("runtime.dynamic_sampling with runtime.use_partial_rollout is not supported yet; set one "
                        "of them to false")
    return problems


def _agent(cfg: ChatLearnConfig, engine: str, spec: EngineSpec, modules: Mapping[str, Any]) -> list[str]:
    """``runtime.task_type: agent``: the producer (synced from a trainer that trains multi-turn samples, as a
    partial rollout's) continues its conversations turn by turn (``continues_responses``); the environment class
    loads and has reset/step."""
    rt = cfg.runtime
    agent = rt.agent
    if rt.task_type != "agent":  # a value other than the default (a deployment's form sends every field)
        default = type(agent)()
        changed = [f for f in type(agent).model_fields if getattr(agent, f) != getattr(default, f)]
        return [f"runtime.agent.{f}: only used with runtime.task_type: agent; remove it" for f in changed]
    problems = []
    producer, src = _generator(cfg, spec)
    if src is None or not spec.multi_turn:
        problems.append(f"runtime.task_type: agent: the {engine!r} engine has no policy-gradient trainer for "
                        "multi-turn samples; use grpo, rlhf (PPO) or an engine of theirs")
    if agent.env is None:
        problems.append("runtime.agent.env: task_type: agent needs an environment class, 'package.module:Class'")
    else:
        try:  # the check chatlearn.envs.base.load_environment makes (this layer cannot import that one)
            import_class(agent.env, ("reset", "step"), "an environment class")
        except (ValueError, TypeError) as exc:
            problems.append(f"runtime.agent.env: {exc}")
    cls = _module_class(producer, cfg, modules, engine) if producer in cfg.models else None
    if cls is not None and not getattr(cls, "continues_responses", False):
        problems.append(f"runtime.task_type: agent: models.{producer}'s module {cls.__name__} cannot continue a "
                        "conversation (continues_responses); multi-turn rollouts need the built-in policy")
    for name, on in (("max_staleness", rt.max_staleness > 0), ("use_partial_rollout", rt.use_partial_rollout),
                      ("dynamic_sampling", rt.dynamic_sampling)):
        if on:
            problems.append(f"runtime.{name} with runtime.task_type: agent is not supported yet (multi-turn "
                            "samples are generated one episode at a time); turn one of them off")
    policy = cfg.models.get(producer)
    new_tokens = (policy.args_dict or {}).get("max_new_tokens") if policy is not None else None
    if isinstance(new_tokens, int) and new_tokens > agent.max_total_tokens:
        problems.append(f"runtime.agent.max_total_tokens: {agent.max_total_tokens} is less than models.{producer} "
                        f"max_new_tokens ({new_tokens}): not even one answer fits")
    return problems


def _partial_rollout(cfg: ChatLearnConfig, engine: str, spec: EngineSpec, modules: Mapping[str, Any]) -> list[str]:
    """``runtime.use_partial_rollout``: the producer (synced from the trainer every episode, as a pipelined
    run's) continues responses over several episodes (``continues_responses`` on its module class), each round's
    token budget at least one token; ``mini_response_per_prompt`` below the group size (ChatLearn's assert);
    an episode trains the groups that finished, so the loader must take what it is given."""
    rt = cfg.runtime
    if not rt.use_partial_rollout:
        return []
    prc = rt.partial_rollout_manager_config
    producer, src = _generator(cfg, spec)
    if src is None:
        return [f"runtime.use_partial_rollout: the {engine!r} engine does not generate with a copy of the model it "
                "trains (a policy synced from ppo_policy): there are no responses to continue; set it to false"]
    problems = []
    cls = _module_class(producer, cfg, modules, engine)
    if cls is not None and not getattr(cls, "continues_responses", False):
        problems.append(f"runtime.use_partial_rollout: models.{producer}'s module {cls.__name__} cannot continue a "
                        "response (continues_responses); partial rollouts need the built-in policy")
    if rt.stream_data_loader_type != "dynamic":
        problems.append(f"runtime.stream_data_loader_type: {rt.stream_data_loader_type!r} trains exactly "
                        "sample_per_episode samples, but with use_partial_rollout an episode trains the groups that "
                        "finished (their number varies); set it to 'dynamic'")
    if cfg.models[producer].sync_frequency != 1:
        problems.append(f"models.{producer}.sync_frequency: {cfg.models[producer].sync_frequency} with runtime."
                        "use_partial_rollout is not supported yet (a round continues on the next episode's weights); "
                        "set it to 1")
    n = group_size(cfg, producer)
    mini = prc.mini_response_per_prompt
    if mini is not None and mini >= n:
        problems.append(f"runtime.partial_rollout_manager_config.mini_response_per_prompt: {mini} must be less "
                        f"than models.{producer} num_inference_per_prompt ({n}), as ChatLearn asserts")
    max_new = max_new_tokens(cfg, producer)
    if isinstance(max_new, int) and max_new > 0:
        budgets = prc.round_budgets(max_new)
        if min(budgets) < 1:
            problems.append(f"runtime.partial_rollout_manager_config.rollout_ratio: {prc.rollout_ratio} of "
                            f"models.{producer} max_new_tokens {max_new} gives rounds of {budgets} tokens; every round "
                            "needs at least one (fewer rounds, or a longer max_new_tokens)")
    return problems


def max_new_tokens(cfg: ChatLearnConfig, producer: str = "policy") -> int:
    """The producer's ``max_new_tokens`` (the built-in policy's default when not set)."""
    return (cfg.models[producer].args_dict or {}).get("max_new_tokens", 16)


def group_size(cfg: ChatLearnConfig, producer: str = "policy") -> int:
    """``num_inference_per_prompt`` of the producer (responses sampled per prompt; 1 when not set)."""
    args = cfg.models[producer].args_dict if producer in cfg.models else {}
    value = (args or {}).get("num_inference_per_prompt", 1)
    return value if isinstance(value, int) and value >= 1 else 1


def _groups(cfg: ChatLearnConfig, name: str, spec: EngineSpec, modules: Mapping[str, Any]) -> list[str]:
    """Prompt groups must be whole wherever they are cut: per episode, per generation batch, and (a trainer that
    builds its samples inside each group: online DPO's pairs) per training micro-batch. A trainer's KL term to
    the reference needs the reference."""
    problems = _kl_needs_reference(cfg, name, spec, modules)
    rt, producer = cfg.runtime, spec.producer
    if producer not in cfg.models:
        return problems
    raw = (cfg.models[producer].args_dict or {}).get("num_inference_per_prompt", 1)
    if not isinstance(raw, int) or raw < 1:
        return problems  # the producer's args_schema reports it
    n, pre = raw, f"models.{producer}.args_dict.num_inference_per_prompt"
    if spec.groups and n < 2:
        problems.append(f"{pre}: the {name} engine compares several responses to the same prompt; set it to 2 "
                        f"or more (ChatLearn's GRPO examples use 8 to 32), got {n}")
    if n > 1:
        if rt.sample_per_episode % n:
            problems.append(f"runtime.sample_per_episode: {rt.sample_per_episode} is not a multiple of {pre} "
                            f"({n}); an episode must hold whole prompt groups")
        gbs = cfg.models[producer].generation_batch_size or rt.generation_batch_size
        if gbs % n:
            problems.append(f"runtime.generation_batch_size: {gbs} is not a multiple of {pre} ({n}); a generation "
                            "batch must hold whole prompt groups")
        if rt.consumed_samples % n:
            problems.append(f"runtime.consumed_samples: {rt.consumed_samples} is not a multiple of {pre} ({n})")
    if spec.pairs_in_groups and n > 1:
        micro = rt.train_micro_batch_size
        if micro % n or rt.sample_per_episode % micro:
            problems.append(f"runtime.train_micro_batch_size: online DPO builds its pairs inside each prompt's "
                            f"group, so a micro-batch must hold whole groups: it must be a multiple of {pre} ({n}) "
                            f"and divide sample_per_episode ({rt.sample_per_episode}), got {micro}")
        if rt.max_relay_episode != 0:
            problems.append("runtime.max_relay_episode: relay is not supported with online DPO yet (a relay hook "
                            "may break prompt groups)")
    return problems


def _kl_needs_reference(cfg: ChatLearnConfig, name: str, spec: EngineSpec, modules: Mapping[str, Any]) -> list[str]:
    """A trainer with a KL loss term (``kl_coef`` in its args: GRPO's) reads the reference's log-probs."""
    if "reference" in cfg.models or "reference" in modules:
        return []
    problems = []
    for trainer in spec.trainers:
        kl = _trainer_args(cfg, trainer, modules, name).get("kl_coef", 0.0)
        if isinstance(kl, int | float) and kl > 0 and "kl_coef" in _arg_fields(trainer, cfg, modules, name):
            hint = "add one" if "reference" in spec.roles else f"the {name} engine has none"
            problems.append(f"models.{trainer}.args_dict.kl_coef: {kl} needs a reference model (models.reference); "
                            f"{hint} or set kl_coef to 0")
    return problems


def _arg_fields(model: str, cfg: ChatLearnConfig, modules: Mapping[str, Any], engine: str) -> dict[str, Any]:
    """The fields of a model's module's ``args_schema`` ({} for a module without one)."""
    schema = getattr(_module_class(model, cfg, modules, engine), "args_schema", None)
    return dict(getattr(schema, "model_fields", {}))


def _trainer_args(cfg: ChatLearnConfig, model: str, modules: Mapping[str, Any], engine: str) -> dict[str, Any]:
    """A model's ``args_dict`` over its module's ``args_schema`` defaults (what the module will read)."""
    fields = _arg_fields(model, cfg, modules, engine)
    given = (cfg.models[model].args_dict or {}) if model in cfg.models else {}
    return {**{k: f.default for k, f in fields.items() if not f.is_required()}, **given}


def _evaluation(cfg: ChatLearnConfig, engine: str, spec: EngineSpec) -> list[str]:
    """An eval asked of a training run needs the engine's evaluator flow (ChatLearn's ``Evaluator``); without
    one it is refused, not skipped."""
    rt = cfg.runtime
    if not spec.trains or spec.evaluates:
        return []
    why = f"the {engine!r} engine has no evaluator flow (a chatlearn.Evaluator) to run it"
    problems = []
    if rt.eval_episode_interval > 0:
        problems.append(f"runtime.eval_episode_interval: {rt.eval_episode_interval} evaluates every "
                        f"{rt.eval_episode_interval} episode(s), but {why}; set it to 0")
    if rt.enable_eval_before_training:
        problems.append(f"runtime.enable_eval_before_training: true evaluates before the first episode, but {why}; "
                        "set it to false")
    return problems


def _lora(cfg: ChatLearnConfig, names: list[str], modules: Mapping[str, Any], engine: str) -> list[str]:
    """LoRA needs a module that trains adapters (``supports_lora``); elsewhere the flag would do nothing."""
    problems = []
    for name in names:
        if cfg.models[name].lora.enable_lora:
            cls = _module_class(name, cfg, modules, engine)
            if cls is not None and not getattr(cls, "supports_lora", False):
                problems.append(f"models.{name}.lora.enable_lora: {cls.__name__} does not train LoRA adapters (the "
                                "policy trainers do: ppo_policy of the rlhf, grpo, dpo and online_dpo engines)")
    return problems


def _rollout_engine(cfg: ChatLearnConfig, names: list[str], modules: Mapping[str, Any], engine: str) -> list[str]:
    """``runtime.rollout_engine`` names an engine of the generating modules' registry (a module class with
    ``rollout_engines``, name -> engine class: the built-in policy's is
    ``chatlearn.models.hf.rollout.ROLLOUT_ENGINES``), and the engine class says what it cannot run (its
    ``problems(cfg, model)``: pipeline stages, a name only registered to be refused); a value no model of the
    run uses is refused, not ignored."""
    name, default = cfg.runtime.rollout_engine, type(cfg.runtime).model_fields["rollout_engine"].default
    users = [(m, cls) for m in names
             if (cls := _module_class(m, cfg, modules, engine)) is not None and hasattr(cls, "rollout_engines")]
    if not users:
        return [] if name == default else [
            f"runtime.rollout_engine: {name!r}, but no model of the {engine!r} engine generates with a rollout "
            f"engine (only {default!r}, the default, is accepted there)"]
    problems: list[str] = []
    for model, cls in users:
        registry = cls.rollout_engines
        if name not in registry:
            known = sorted(n for n, e in registry.items() if getattr(e, "implemented", True))
            return [f"runtime.rollout_engine: {name!r} is not a rollout engine{did_you_mean(name, registry)} (one "
                    f"of {known})"]
        problems += registry[name].problems(cfg, model)
    return list(dict.fromkeys(problems))


def _advantage_shape(cfg: ChatLearnConfig, engine: str, spec: EngineSpec, roles: list[str],
                     modules: Mapping[str, Any]) -> list[str]:
    """The advantages the reward's estimator makes (per response token or per sequence: the reward module class
    says, ``estimator_shape``) are ones every trainer of the engine takes (``advantage_shapes`` on its module
    class): GRPO's per-sequence advantages on the PPO trainer would fail at its first step."""
    if "reward" not in cfg.models:
        return []
    reward = _module_class("reward", cfg, modules, engine)
    given = (cfg.models["reward"].args_dict or {}).get("advantage_estimator") or spec.advantage_estimator
    shape_of = getattr(reward, "estimator_shape", None)
    made = shape_of(given) if shape_of is not None and isinstance(given, str) else None
    if made is None:
        return []  # a reward of one's own, or a name its args_schema refuses
    shape, what = made
    problems = []
    for name in roles:
        cls = _module_class(name, cfg, modules, engine)
        takes = getattr(cls, "advantage_shapes", None)
        if takes is not None and shape not in takes:
            problems.append(f"models.reward.args_dict.advantage_estimator: {given!r} makes advantages {what}, but "
                            f"models.{name} ({cls.__name__}) takes {' or '.join(takes)} advantages only; use one of "
                            f"{reward.estimators_of_shape(tuple(takes))}")
    return problems


def _environment_args(cfg: ChatLearnConfig) -> list[str]:
    """``runtime.agent.env_args`` are the environment class's constructor arguments (a key it does not take is
    refused with the nearest one it does, a required one it lacks is named), and what the class itself says of
    them (``args_problems(env_args)``, e.g. its tools' names against their registry). (A class that does not
    import is ``_agent``'s to report.)"""
    agent = cfg.runtime.agent
    if cfg.runtime.task_type != "agent" or agent.env is None:
        return []
    try:
        cls = import_object(agent.env, "Class")
        params = inspect.signature(cls).parameters
    except (ValueError, TypeError):
        return []
    pre = "runtime.agent.env_args"
    named = [p for p in params.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    problems = []
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        takes = [p.name for p in named]
        problems += [f"{pre}.{key}: not an argument of {cls.__name__}{did_you_mean(key, takes)} (it takes "
                     f"{takes or 'none'})" for key in agent.env_args if key not in takes]
    missing = [p.name for p in named if p.default is p.empty and p.name not in agent.env_args]
    if missing:
        problems.append(f"{pre}: {cls.__name__} needs {missing}")
    checked = getattr(cls, "args_problems", None)
    if callable(checked) and not problems:
        problems += [f"{pre}.{line}" for line in checked(dict(agent.env_args))]
    return problems


def _packing(cfg: ChatLearnConfig, names: list[str], modules: Mapping[str, Any], engine: str) -> list[str]:
    """``packing`` needs a module that runs packed forwards (``supports_packing``; every layout it runs packs,
    pipeline stages included): never accepted and ignored (the run would be the padded one, at the padded
    cost, with packing reported on)."""
    problems = []
    for name in names:
        m = cfg.models[name]
        if not m.packing:
            continue
        cls = _module_class(name, cfg, modules, engine)
        if cls is None:
            continue  # reported by _module_args
        if not getattr(cls, "supports_packing", False):
            problems.append(f"models.{name}.packing: true is not supported yet by {cls.__name__} (the reference, "
                            f"value, PPO/GRPO/DPO trainers and the DPO pair reference pack); leave it at false")
    return problems


def _old_logprobs(cfg: ChatLearnConfig, engine: str, spec: EngineSpec, modules: Mapping[str, Any]) -> list[str]:
    """A trainer that says where its old log-probs come from (``old_logprobs`` in its args: GRPO's) takes them
    from generation only when the sampler holds its weights at generation time (synced every episode) and
    computes log-probs the same way (temperature, dtype); from its own forward pass only when the environment
    flow calls it (``forward_step``)."""
    producer, src = _generator(cfg, spec)
    if src is None or "old_logprobs" not in _arg_fields(src, cfg, modules, engine):
        return []
    trainer = cfg.models[src].args_dict or {}
    source, rt = trainer.get("old_logprobs", "generation"), cfg.runtime
    correction = trainer.get("rollout_correction", "none")
    if source == "trainer" and (src, "forward_step") not in spec.scorers:
        return [f"models.{src}.args_dict.old_logprobs: trainer takes the old log-probs from {src}'s own forward "
                f"pass, but the {engine} engine's environment flow never calls {src}.forward_step (they would be "
                f"the sampler's); use generation or current"]
    if correction != "none" and source not in ("trainer", "current"):
        return [f"models.{src}.args_dict.rollout_correction: {correction} weighs the proximal policy against "
                f"the sampler's, and the proximal log-probs are the trainer's own: set old_logprobs: trainer (its "
                f"forward pass) or current (the training forward's, one optimizer step per episode; it is {source})"]
    if source == "current":
        # with a correction the detached training log-probs are the proximal policy's and the sampler's the
        # behaviour's, so stale samples are weighed, not mistaken for on-policy ones
        if rt.max_staleness > 0 and correction == "none":
            return [f"models.{src}.args_dict.old_logprobs: current takes the training forward's own "
                    f"log-probs as the old ones, but with runtime.max_staleness: {rt.max_staleness} the samples "
                    f"come from older weights; use generation (the behaviour policy's) or trainer, or keep current "
                    f"with a rollout_correction (it weighs them by the sampler's log-probs)"]
        # a train_global_batch_size <= 0 is the runtime check's to name
        if rt.train_global_batch_size <= 0 or rt.steps_per_episode == 1:
            return []
        return [f"models.{src}.args_dict.old_logprobs: current takes the training forward's own log-probs as "
                f"the old ones, exact only for one optimizer step per episode, but runtime.sample_per_episode "
                f"{rt.sample_per_episode} over runtime.train_global_batch_size {rt.train_global_batch_size} "
                f"times runtime.num_training_epoch {rt.num_training_epoch} makes {rt.steps_per_episode}; use "
                f"generation or trainer"]
    if source != "generation":
        return []
    policy, problems = cfg.models[producer].args_dict or {}, []
    why = ("old_logprobs: generation takes the sampler's log-probs as the trainer's; set old_logprobs: trainer for "
           "the trainer's own forward pass")
    if cfg.models[producer].sync_frequency != 1:
        problems.append(f"models.{producer}.sync_frequency: {cfg.models[producer].sync_frequency} leaves the "
                        f"{producer} behind the trainer between syncs, but {why}")
    for key, default in (("temperature", 1.0), ("dtype", "float32")):
        if policy.get(key, default) != trainer.get(key, default):
            problems.append(f"models.{src}.args_dict.{key}: {trainer.get(key, default)!r} differs from the "
                            f"{producer}'s {policy.get(key, default)!r}, but {why}")
    return problems


# the reward's experience settings; each advantage estimator reads some (ADVANTAGE_ESTIMATOR_SETTINGS)
REWARD_SETTINGS = ("kl_coef", "kl_estimator", "gamma", "lam")


def _reward_settings(cfg: ChatLearnConfig, engine: str, spec: EngineSpec, modules: Mapping[str, Any]) -> list[str]:
    """The experience settings of each reward that makes the experience do what its advantage estimator says or
    are refused: a setting it does not read (GAE's lam under GRPO), a KL penalty with no reference to take it
    against, and an estimator whose advantages the trainer must whiten over the global batch (REINFORCE++) with
    the trainer's whitening off. The reward's module class knows the estimators (``estimator_settings``,
    ``estimator_whitened``)."""
    problems = []
    _, src = _generator(cfg, spec)
    for name in _experience_rewards(cfg, spec, modules, engine, "estimator_settings"):
        cls = _module_class(name, cfg, modules, engine)
        given = (cfg.models[name].args_dict or {}).get("advantage_estimator")
        estimator = given if given is not None else spec.advantage_estimator
        reads = cls.estimator_settings(estimator) if isinstance(estimator, str) else None
        if reads is None:
            continue  # no estimator named (`_advantage_estimator`), or one its args_schema refuses
        pre, reward = f"models.{name}.args_dict", cfg.models[name].args_dict or {}
        trainer = _arg_fields(src, cfg, modules, engine) if src is not None else {}
        for key in REWARD_SETTINGS:
            if key in reward and key not in reads:
                hint = (f" (the KL loss term is models.{src}.args_dict.kl_coef)"
                        if key.startswith("kl_") and "kl_coef" in trainer else "")
                problems.append(f"{pre}.{key}: the advantage estimator {estimator!r} does not use it (it reads "
                                f"{list(reads) or 'none of ' + str(list(REWARD_SETTINGS))}){hint}; remove it")
        kl = reward.get("kl_coef")
        if "kl_coef" in reads and isinstance(kl, int | float) and kl > 0 and "reference" not in cfg.models:
            problems.append(f"{pre}.kl_coef: {kl} penalises the KL to the reference; add models.reference or set "
                            "kl_coef to 0")
        limit = reward.get("max_response_length")
        if reward.get("overlong_buffer_len") and spec.producer in cfg.models and \
                limit != max_new_tokens(cfg, spec.producer):
            problems.append(f"{pre}.max_response_length: {limit} is not the {spec.producer}'s max_new_tokens "
                            f"({max_new_tokens(cfg, spec.producer)}), the length the overlong penalty counts to")
        if cls.estimator_whitened(estimator) and "whiten_advantages" in trainer and \
                not _trainer_args(cfg, src, modules, engine).get("whiten_advantages"):  # type: ignore[arg-type]
            problems.append(f"models.{src}.args_dict.whiten_advantages: the advantage estimator {estimator!r} is "
                            "whitened over each global batch by the trainer; set it to true")
    return problems


def _experience_rewards(cfg: ChatLearnConfig, spec: EngineSpec, modules: Mapping[str, Any], engine: str,
                        knows: str) -> list[str]:
    """The models whose ``forward_step`` in the environment makes the experience's advantages: those whose module
    class knows the estimators (``knows``: ``estimator_inputs``, ``estimator_settings``)."""
    return [m for m, method in dict.fromkeys(spec.scorers) if method == "forward_step" and m in cfg.models
            and getattr(_module_class(m, cfg, modules, engine), knows, None) is not None]


# the batch fields an advantage estimator may read (chatlearn.algorithms.registry.ADVANTAGE_ESTIMATOR_INPUTS),
# by the role of the engine that makes them ("policy": the producer, whatever its name)
_MADE_BY = {"logprobs": "policy", "response_mask": "policy", "ref_logprobs": "reference", "values": "value"}


def _advantage_estimator(cfg: ChatLearnConfig, engine: str, spec: EngineSpec, modules: Mapping[str, Any]) -> list[str]:
    """The advantage estimator of each reward that makes the experience (``args_dict.advantage_estimator``, else
    the one the engine's trainer declares: `EngineSpec.advantage_estimator`) is named and reads only what the
    engine's models make (its reward module says what an estimator reads: ``estimator_inputs``). (An unknown
    name is the reward's ``args_schema``'s error.) A trainer that trains on advantages needs an environment that
    makes them: a model's ``forward_step`` after generation (a reward's)."""
    problems = []
    if spec.advantage_estimator is not None and not any(method == "forward_step" for _, method in spec.scorers):
        problems.append(f"runtime.engine: the {engine} engine trains {list(spec.trainers)} on advantages "
                        f"({spec.advantage_estimator!r} by default), but its environment flow makes none: after "
                        "generation it calls no model's forward_step (a reward's makes them)")
    for name in _experience_rewards(cfg, spec, modules, engine, "estimator_inputs"):
        pre = f"models.{name}.args_dict.advantage_estimator"
        given = (cfg.models[name].args_dict or {}).get("advantage_estimator")
        if given is None and spec.advantage_estimator is None:
            problems.append(f"{pre}: {name} makes the experience, but no model the {engine} engine trains declares "
                            "the advantage estimator it trains on (a module's default_advantage_estimator); name "
                            "one (e.g. gae, grpo)")
            continue
        estimator = given if given is not None else spec.advantage_estimator
        inputs = _module_class(name, cfg, modules, engine).estimator_inputs(estimator)
        if inputs is None:
            continue  # a name its args_schema refuses
        made = {field for field, role in _MADE_BY.items()
                if (spec.producer if role == "policy" else role) in spec.roles}
        if spec.groups or group_size(cfg, spec.producer or "policy") > 1:
            made.add("group_id")  # the responses to one prompt share it (_groups checks the group size)
        missing = [f for f in inputs if f not in made]
        if missing:
            problems.append(f"{pre}: {estimator!r} reads {missing}, which no model of the {engine} engine makes (the "
                            f"{engine} engine runs {spec.advantage_estimator!r})")
    return problems
