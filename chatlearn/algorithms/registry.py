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
"""

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Any]] = {}
# the batch fields each estimator reads besides ``scores``: a batch without them is an error naming them, and
# the config checks refuse an estimator whose inputs no model of the engine makes
ADVANTAGE_ESTIMATOR_INPUTS: dict[str, tuple[str, ...]] = {}
POLICY_LOSSES: dict[str, Callable[..., Any]] = {}
VALUE_LOSSES: dict[str, Callable[..., Any]] = {}
ROLLOUT_CORRECTIONS: dict[str, Callable[..., Any]] = {}
KL_ESTIMATORS: dict[str, Callable[..., Any]] = {}
# the reward's settings each estimator reads (kl_coef, kl_estimator, gamma, lam): a setting given for an
# estimator that does not read it is a config error, never ignored
ADVANTAGE_ESTIMATOR_SETTINGS: dict[str, tuple[str, ...]] = {}
# the estimators whose advantages the trainer whitens over each global batch (REINFORCE++)
WHITENED_ESTIMATORS: set[str] = set()


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


def register_advantage_estimator(name: str, inputs: tuple[str, ...] = (), settings: tuple[str, ...] = (),
                                 whiten: bool = False) -> Callable[[F], F]:
    """Decorator: register an advantage estimator ``fn(batch, args) -> dict`` that reads ``inputs`` (batch
    fields besides ``scores``; with a reward KL penalty also ``logprobs`` and ``ref_logprobs``) and the reward's
    ``settings``, and returns the fields it adds, ``advantages`` among them; ``whiten``: the trainer whitens its
    advantages over each global batch."""
    register = _register(ADVANTAGE_ESTIMATORS, "advantage estimator", name)

    def decorator(fn: F) -> F:
        register(fn)
        ADVANTAGE_ESTIMATOR_INPUTS[name] = tuple(inputs)
        ADVANTAGE_ESTIMATOR_SETTINGS[name] = tuple(settings)
        if whiten:
            WHITENED_ESTIMATORS.add(name)
        return fn

    return decorator


def register_policy_loss(name: str) -> Callable[[F], F]:
    """Decorator: register a policy loss returning ``(loss scalar, stats dict[str, float])``."""
    return _register(POLICY_LOSSES, "policy loss", name)


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
