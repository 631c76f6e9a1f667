"""Name -> function registries for the pluggable pieces of the RL math.

The trainer never imports a concrete algorithm: it reads names from the config
(``advantage_estimator: gae``, ``policy_loss: ppo_clip``, ...) and resolves them
here.  A new algorithm (GRPO advantages, a DPO-style loss, ...) therefore plugs
in by decorating a pure tensor function in its own module and importing that
module once; no trainer code changes.

There are separate registries rather than one keyed by ``(kind, name)``
because the same short name (``"ppo_clip"``) legitimately names both a policy
loss and a value loss, and because each kind has its own call contract:

* advantage estimator: ``fn(batch, args) -> dict`` (the scored batch and the reward's settings in, the
  experience fields it adds out: ``advantages`` and whatever else it makes; see
  :mod:`chatlearn.algorithms.advantages`)
* policy loss: ``fn(logprobs, old_logprobs, advantages, mask, **hparams) -> (loss, stats)``
* value loss: ``fn(values, old_values, returns, mask, **hparams) -> (loss, stats)``
* rollout correction: ``fn(proximal_logprobs, behaviour_logprobs, mask, *, cap) -> (weights, stats)``, the
  per-token importance weights of samples another policy generated (see :mod:`chatlearn.algorithms.off_policy`)
* KL estimator: ``fn(logprobs, ref_logprobs) -> [B, T]`` (see :mod:`chatlearn.algorithms.kl`)

A policy loss also declares its family (``POLICY_LOSS_FAMILIES``): the keyword arguments a trainer passes it besides
those four tensors, so it runs on the trainers of its family only. A trainer's ``args_schema`` names the family it
takes, and the config check refuses any other loss before anything starts (:func:`name_problem`,
:func:`policy_loss_problem`): every name a config gives is checked here, against the registry, not a list.
"""

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from chatlearn.config.errors import did_you_mean

F = TypeVar("F", bound=Callable[..., Any])

ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Any]] = {}
# the batch fields each estimator reads besides ``scores``: a batch without them is an error naming them, and
# the config checks refuse an estimator whose inputs no model of the engine makes
ADVANTAGE_ESTIMATOR_INPUTS: dict[str, tuple[str, ...]] = {}
POLICY_LOSSES: dict[str, Callable[..., Any]] = {}
# what each family of policy losses is called with besides (logprobs, old_logprobs, advantages, mask): a trainer
# passes exactly these, so a loss of another family fails on its first step
POLICY_LOSS_FAMILIES: dict[str, str] = {
    "ppo": "the PPO trainer's cliprange and clip_ratio_c (verl's dual clip)",
    "grpo": "the GRPO trainer's clip ratios (pos/neg/diff/final), loss_agg_mode with the global batch's units, and "
            "the rollout correction's token weights",
}
POLICY_LOSS_FAMILY: dict[str, str] = {}  # loss name -> its family
VALUE_LOSSES: dict[str, Callable[..., Any]] = {}
ROLLOUT_CORRECTIONS: dict[str, Callable[..., Any]] = {}
KL_ESTIMATORS: dict[str, Callable[..., Any]] = {}
# the reward's settings each estimator reads (kl_coef, kl_estimator, gamma, lam): a setting given for an
# estimator that does not read it is a config error, never ignored
ADVANTAGE_ESTIMATOR_SETTINGS: dict[str, tuple[str, ...]] = {}
# the estimators whose advantages the trainer whitens over each global batch (REINFORCE++)
WHITENED_ESTIMATORS: set[str] = set()
# the advantages each estimator makes: one per response token ([B, T]) or one per sequence ([B], a group's);
# a trainer says which it takes (``advantage_shapes`` on its module class), and the config check matches them
ADVANTAGE_SHAPES = {"token": "per response token [B, T]", "sequence": "per sequence [B]"}
ADVANTAGE_ESTIMATOR_SHAPE: dict[str, str] = {}


def _register(registry: dict[str, Callable[..., Any]], kind: str, name: str) -> Callable[[F], F]:
    """Build a decorator that stores ``fn`` under ``name`` and returns ``fn`` unchanged.

    Registering a *different* function under a taken name is an error: silently
    replacing e.g. ``"gae"`` would change training behaviour depending on import
    order, which is very hard to debug.  Re-registering the very same object is
    allowed so that importing a module twice is harmless.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} name must be a non-empty string, got {name!r}")

    def decorator(fn: F) -> F:
        existing = registry.get(name)
        if existing is not None and existing is not fn:
            raise ValueError(
                f"{kind} {name!r} is already registered to {existing.__module__}.{existing.__qualname__}"
            )
        registry[name] = fn
        return fn

    return decorator


def _get(registry: dict[str, Callable[..., Any]], kind: str, name: str) -> Callable[..., Any]:
    """Look ``name`` up, failing with the list of known names (a config typo is the usual cause)."""
    try:
        return registry[name]
    except KeyError:
        raise KeyError(f"Unknown {kind} {name!r}; known: {sorted(registry)}") from None


def register_advantage_estimator(name: str, *, shape: str, inputs: tuple[str, ...] = (),
                                 settings: tuple[str, ...] = (), whiten: bool = False) -> Callable[[F], F]:
    """Decorator: register an advantage estimator ``fn(batch, args) -> dict`` that reads ``inputs`` (batch
    fields besides ``scores``; with a reward KL penalty also ``logprobs`` and ``ref_logprobs``) and the reward's
    ``settings``, and returns the fields it adds, ``advantages`` among them, of ``shape`` (a key of
    ``ADVANTAGE_SHAPES``); ``whiten``: the trainer whitens its advantages over each global batch."""
    if shape not in ADVANTAGE_SHAPES:
        raise ValueError(f"advantage estimator {name!r}: unknown shape {shape!r}; known: {sorted(ADVANTAGE_SHAPES)}")
    register = _register(ADVANTAGE_ESTIMATORS, "advantage estimator", name)

    def decorator(fn: F) -> F:
        register(fn)
        ADVANTAGE_ESTIMATOR_SHAPE[name] = shape
        ADVANTAGE_ESTIMATOR_INPUTS[name] = tuple(inputs)
        ADVANTAGE_ESTIMATOR_SETTINGS[name] = tuple(settings)
        if whiten:
            WHITENED_ESTIMATORS.add(name)
        return fn

    return decorator


def register_policy_loss(name: str, family: str) -> Callable[[F], F]:
    """Decorator: register a policy loss of ``family`` (a key of ``POLICY_LOSS_FAMILIES``: what its trainer calls
    it with) returning ``(loss scalar, stats dict[str, float])``."""
    if family not in POLICY_LOSS_FAMILIES:
        raise ValueError(f"policy loss {name!r}: unknown family {family!r}; known: {sorted(POLICY_LOSS_FAMILIES)}")
    register = _register(POLICY_LOSSES, "policy loss", name)

    def decorator(fn: F) -> F:
        register(fn)
        POLICY_LOSS_FAMILY[name] = family
        return fn

    return decorator


def register_value_loss(name: str) -> Callable[[F], F]:
    """Decorator: register a value (critic) loss returning ``(loss scalar, stats dict[str, float])``."""
    return _register(VALUE_LOSSES, "value loss", name)


def get_advantage_estimator(name: str) -> Callable[..., Any]:
    """Return the advantage estimator registered as ``name``; ``KeyError`` lists the known names."""
    return _get(ADVANTAGE_ESTIMATORS, "advantage estimator", name)


def advantage_estimator_inputs(name: str) -> tuple[str, ...]:
    """The batch fields the estimator registered as ``name`` reads (besides ``scores``)."""
    get_advantage_estimator(name)
    return ADVANTAGE_ESTIMATOR_INPUTS.get(name, ())


def advantage_estimator_settings(name: str) -> tuple[str, ...]:
    """The reward settings the estimator registered as ``name`` reads (``ADVANTAGE_ESTIMATOR_SETTINGS``)."""
    get_advantage_estimator(name)
    return ADVANTAGE_ESTIMATOR_SETTINGS.get(name, ())


def advantage_estimator_shape(name: str) -> str:
    """The advantages the estimator registered as ``name`` makes: ``token`` or ``sequence`` (``ADVANTAGE_SHAPES``)."""
    get_advantage_estimator(name)
    return ADVANTAGE_ESTIMATOR_SHAPE[name]


def get_policy_loss(name: str) -> Callable[..., Any]:
    """Return the policy loss registered as ``name``; ``KeyError`` lists the known names."""
    return _get(POLICY_LOSSES, "policy loss", name)


def get_value_loss(name: str) -> Callable[..., Any]:
    """Return the value loss registered as ``name``; ``KeyError`` lists the known names."""
    return _get(VALUE_LOSSES, "value loss", name)


def register_rollout_correction(name: str) -> Callable[[F], F]:
    """Decorator: register a rollout correction returning ``(per-token weights [B, T], stats dict[str, float])``."""
    return _register(ROLLOUT_CORRECTIONS, "rollout correction", name)


def get_rollout_correction(name: str) -> Callable[..., Any]:
    """Return the rollout correction registered as ``name``; ``KeyError`` lists the known names."""
    return _get(ROLLOUT_CORRECTIONS, "rollout correction", name)


def register_kl_estimator(name: str) -> Callable[[F], F]:
    """Decorator: register a per-token KL estimator ``fn(logprobs, ref_logprobs) -> [B, T]``."""
    return _register(KL_ESTIMATORS, "KL estimator", name)


def get_kl_estimator(name: str) -> Callable[..., Any]:
    """Return the KL estimator registered as ``name``; ``KeyError`` lists the known names."""
    return _get(KL_ESTIMATORS, "KL estimator", name)


def name_problem(kind: str, name: Any, known: Iterable[str]) -> str | None:
    """Why ``name`` is not one of the ``known`` names of ``kind`` (a registry's keys), as one line with the
    nearest known name; None when it is one. The config check's message for every registered piece."""
    known = sorted(known)
    if isinstance(name, str) and name in known:
        return None
    return f"unknown {kind} {name!r}{did_you_mean(name, known)} (known: {', '.join(known)})"


def policy_loss_problem(name: Any, family: str, trainer: str) -> str | None:
    """Why the policy loss ``name`` cannot run on ``trainer``, which calls losses of ``family``: unknown, or of
    another family (naming what that family is called with); None when it can."""
    of_family = [n for n, f in POLICY_LOSS_FAMILY.items() if f == family]
    problem = name_problem("policy loss", name, POLICY_LOSSES)
    if problem is not None:
        return problem
    if POLICY_LOSS_FAMILY[name] != family:
        other = POLICY_LOSS_FAMILY[name]
        return (f"{name!r} is a {other}-family policy loss (called with {POLICY_LOSS_FAMILIES[other]}), but "
                f"{trainer} calls {family}-family losses: {', '.join(sorted(of_family))}")
    return None
