"""`chatlearn` command: `train`, `eval` and `config`, each `[CONFIG] [key=value ...]`.

Without CONFIG the embedded default (`configs/default.yaml`) is used. Dotted overrides after the config win
over everything in the files (`runtime.num_episode=3 models.policy.num_cpu=1`). The config is validated,
with every problem listed, before any Prefect or Ray resource is created.
"""

import argparse
import json
import os
import sys
from pathlib import Path


def default_config_path() -> Path:
    return Path(__file__).resolve().parents[1] / "configs" / "default.yaml"


def _split_args(items: list[str]) -> tuple[str, list[str]]:
    config = None
    overrides = []
    for item in items:
        if "=" not in item and config is None:
            config = item
        else:
            overrides.append(item)
    return config or str(default_config_path()), overrides


def _load(items: list[str]):
    from chatlearn.runtime.engine import build_engine, load_run_config

    path, overrides = _split_args(items)
    cfg = load_run_config(path, overrides)
    build_engine(cfg)  # module args are part of what must be valid before anything starts
    return cfg


def cmd_config(items: list[str]) -> int:
    cfg = _load(items)
    print(json.dumps(cfg.model_dump(mode="json"), indent=2))
    return 0


def cmd_eval(items: list[str]) -> int:
    from chatlearn.runtime.engine import build_engine, load_run_config

    path, overrides = _split_args(items)
    cfg = load_run_config(path, overrides)
    build_engine(cfg, engine="eval")
    from chatlearn.runtime.prefect_server import local_prefect_api

    with local_prefect_api(announce=lambda msg: print(msg, file=sys.stderr, flush=True)):
        from flows.evaluate import eval_flow

        metrics = eval_flow(cfg)
    print(json.dumps(metrics, indent=1, default=str))
    return 0


def cmd_train(items: list[str]) -> int:
    cfg = _load(items)
    from chatlearn.runtime.prefect_server import local_prefect_api

    with local_prefect_api(announce=lambda msg: print(msg, file=sys.stderr, flush=True)):
        from flows.train import train_flow

        result = train_flow(cfg)
    print(f"run directory: {cfg.runtime.run_dir}", file=sys.stderr)
    if result.get("final_policy"):
        print(f"final policy: {result['final_policy']}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    parser = argparse.ArgumentParser(prog="chatlearn", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in [("train", "train with a config (default: the embedded tiny PPO run)"),
                        ("eval", "evaluate a policy on the eval set (models.policy.args_dict.model_path=DIR)"),
                        ("config", "validate a config and print it resolved, as JSON")]:
        p = sub.add_parser(name, help=help_)
        p.add_argument("args", nargs="*", metavar="CONFIG|key=value")
    ns = parser.parse_args(argv)
    from chatlearn.data.prompts import DataError
    from chatlearn.utils.arguments import ConfigError

    try:
        return {"train": cmd_train, "eval": cmd_eval, "config": cmd_config}[ns.command](ns.args)
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
