"""`chatlearn` command: `train`, `eval`, `config` and `plan`, each `[CONFIG] [key=value ...]`.

Without CONFIG the embedded default (`configs/default.yaml`) is used. Dotted overrides after the config win
over everything in the files (`runtime.num_episode=3 models.policy.num_cpu=1`). `train` and `eval` validate
the config and their engine's needs, with every problem listed, before any Prefect or Ray resource exists;
`config` prints what ChatLearn's loader would resolve (`--check` adds the engine's checks); `plan` prints
where every model rank would run on a cluster of `--nodes` x `--gpus-per-node` without starting Ray.

The commands import torch, Ray and Prefect only when they run, so `chatlearn config` answers at once.
"""

import argparse
import contextlib
import json
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from chatlearn.config import ChatLearnConfig, ConfigError, ConfigWarning, EngineChecks, load_config
from chatlearn.config.engine_checks import engine_name
from chatlearn.config.engines import ENGINES
from chatlearn.data.prompts import DataError
from chatlearn.runtime.dlc import DLCNode, dlc_head, dlc_node, serve_as_worker
from chatlearn.runtime.placement import PlacementError, plan_placement, uniform_cluster
from chatlearn.utils.devices import fake_gpus


def _split_args(items: list[str]) -> tuple[str | None, list[str]]:
    config = None
    overrides = []
    for item in items:
        if "=" not in item and config is None:
            config = item
        else:
            overrides.append(item)
    return config, overrides


def _load(items: list[str], engine: str | None = None, check: bool = True) -> ChatLearnConfig:
    path, overrides = _split_args(items)
    return load_config(path, overrides, [EngineChecks(engine)] if check else [])


def cmd_config(items: list[str], check: bool = False) -> int:
    cfg = _load(items, check=check)
    print(json.dumps(cfg.model_dump(mode="json"), indent=2))
    return 0


def cmd_plan(items: list[str], nodes: int, gpus_per_node: int, cpus_per_node: float | None) -> int:
    cfg = _load(items)
    spec = ENGINES[engine_name(cfg)]
    names = [r for r in spec.roles if r in cfg.models]
    plan = plan_placement(cfg, names, uniform_cluster(nodes, gpus_per_node, cpus_per_node))
    for msg in plan.warnings:
        print(f"chatlearn: warning: placement: {msg}", file=sys.stderr)
    text = json.dumps(plan.to_json(), indent=1)
    # one rank per line: collapse the innermost objects
    print(re.sub(r"\{\s*([^{}\[\]]*?)\s*\}", lambda m: "{" + " ".join(m.group(1).split()) + "}", text))
    return 0


@contextlib.contextmanager
def _dlc_head(node: DLCNode | None) -> Iterator[None]:
    """Rank 0 of a DLC job: the Ray head runs for the command's lifetime and the run joins it."""
    if node is None:
        yield
        return
    with dlc_head(node, fake_gpus() or None) as address:
        os.environ.update(RAY_ADDRESS=address, CHATLEARN_NODE_IP_ADDRESS=node.address,
                          CHATLEARN_WAIT_FOR_NODES=str(node.nodes))
        _announce(f"DLC: Ray head at {address} (rank 0 of the job)")
        yield


def _announce(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def cmd_eval(items: list[str]) -> int:
    # lazy: torch, Ray and Prefect load only for the commands that run something (see the module docstring)
    from chatlearn.runtime.engine import build_engine
    from chatlearn.runtime.prefect_server import local_prefect_api

    cfg = _load(items, engine="eval")
    engine = build_engine(cfg, engine="eval")
    with local_prefect_api(announce=_announce):
        metrics = engine.eval(cfg)
    print(json.dumps(metrics, indent=1, default=str))
    return 0


def cmd_train(items: list[str]) -> int:
    # lazy: torch, Ray and Prefect load only for the commands that run something (see the module docstring)
    from chatlearn.runtime.engine import build_engine
    from chatlearn.runtime.prefect_server import local_prefect_api

    cfg = _load(items)
    engine = build_engine(cfg)
    node = dlc_node(cfg.runtime_env.platform)
    if node is not None and node.rank > 0:  # a DLC worker node: serve Ray until the head is gone
        return serve_as_worker(node, fake_gpus() or None)
    with _dlc_head(node), local_prefect_api(announce=_announce):
        result = engine.learn(cfg)
    print(f"run directory: {cfg.runtime.run_dir}", file=sys.stderr)
    if result.get("final_policy"):
        print(f"final policy: {result['final_policy']}", file=sys.stderr)
    return 0


def _config_warnings_as_lines(previous: Callable[..., None]) -> Callable[..., None]:
    """A `warnings.showwarning` that prints a ConfigWarning as one `chatlearn: warning:` line."""

    def show(message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        if issubclass(category, ConfigWarning):
            print(f"chatlearn: warning: {message}", file=sys.stderr)
        else:
            previous(message, category, filename, lineno, file, line)

    return show


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    previous = warnings.showwarning
    warnings.showwarning = _config_warnings_as_lines(previous)
    try:
        return _main(argv)
    finally:
        warnings.showwarning = previous


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="chatlearn", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in [("train", "train with a config (default: the embedded tiny PPO run)"),
                        ("eval", "evaluate a policy on the eval set (models.policy.args_dict.model_path=DIR)"),
                        ("config", "print a config resolved, as JSON (as ChatLearn's loader resolves it)"),
                        ("plan", "print where every model rank would run on a cluster, as JSON (no Ray started)")]:
        p = sub.add_parser(name, help=help_)
        if name == "plan":
            p.add_argument("--nodes", type=int, default=1, help="nodes in the cluster (default 1)")
            p.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (default 0)")
            p.add_argument("--cpus-per-node", type=float, default=None,
                           help="CPUs per node (default: not limited)")
        if name == "config":
            p.add_argument("--check", action="store_true",
                           help="also run the checks `chatlearn train` runs (engine models, module args, hooks, "
                                "fields not supported yet)")
        p.add_argument("args", nargs="*", metavar="CONFIG|key=value")
    ns = parser.parse_args(argv)
    try:
        if ns.command == "config":
            return cmd_config(ns.args, ns.check)
        if ns.command == "plan":
            return cmd_plan(ns.args, ns.nodes, ns.gpus_per_node, ns.cpus_per_node)
        return {"train": cmd_train, "eval": cmd_eval}[ns.command](ns.args)
    except ConfigError as exc:
        print(f"chatlearn: invalid config ({len(exc.problems)} problem(s)):", file=sys.stderr)
        for problem in exc.problems:
            print(f"  - {problem}", file=sys.stderr)
        return 2
    except PlacementError as exc:
        print(f"chatlearn: {exc}", file=sys.stderr)
        return 2
    except DataError as exc:
        print(f"chatlearn: bad data: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
