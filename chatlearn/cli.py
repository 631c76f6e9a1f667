"""`chatlearn` command: `train`, `eval` and `config`, each `[CONFIG] [key=value ...]`.

Without CONFIG the embedded default (`configs/default.yaml`) is used. Dotted overrides after the config win
over everything in the files (`runtime.num_episode=3 models.policy.num_cpu=1`). `train` and `eval` validate
the config and their engine's needs, with every problem listed, before any Prefect or Ray resource exists;
`config` prints what ChatLearn's loader would resolve (`--check` adds the engine's checks).

The commands import torch, Ray and Prefect only when they run, so `chatlearn config` answers at once.
"""

import argparse
import json
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

from chatlearn.config import ChatLearnConfig, ConfigError, ConfigWarning, EngineChecks, load_config
from chatlearn.data.prompts import DataError


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
    with local_prefect_api(announce=_announce):
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
                        ("config", "print a config resolved, as JSON (as ChatLearn's loader resolves it)")]:
        p = sub.add_parser(name, help=help_)
        if name == "config":
            p.add_argument("--check", action="store_true",
                           help="also run the checks `chatlearn train` runs (engine models, module args, hooks, "
                                "fields not supported yet)")
        p.add_argument("args", nargs="*", metavar="CONFIG|key=value")
    ns = parser.parse_args(argv)
    try:
        if ns.command == "config":
            return cmd_config(ns.args, ns.check)
        return {"train": cmd_train, "eval": cmd_eval}[ns.command](ns.args)
    except ConfigError as exc:
        print(f"chatlearn: invalid config ({len(exc.problems)} problem(s)):", file=sys.stderr)
        for problem in exc.problems:
            print(f"  - {problem}", file=sys.stderr)
        return 2
    except DataError as exc:
        print(f"chatlearn: bad data: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
