"""`chatlearn` command: `train`, `eval`, `config`, `plan`, `deploy`, `serve`, each `[CONFIG] [key=value ...]`,
`server`, `reward-server MODEL_PATH`, `export RUN_DIR OUT` and `trace RUN_DIR`.

CONFIG is a YAML file, or the name of a config shipped with the package, without a folder: `default` (the
embedded default, used without CONFIG), `grpo`, `dpo`, `online_dpo`, `rloo`, `reinforce_pp`, `dapo`, ... (the
repository's `configs/`, so `chatlearn train grpo` works from any directory; a file of that name in the current
directory wins). Dotted overrides after the config win over everything in the files (`runtime.num_episode=3
models.policy.num_cpu=1`).
`train` and `eval` validate the config and their engine's needs, with every problem listed, before any Prefect
or Ray resource exists; `config` prints what ChatLearn's loader would resolve (`--check` adds the engine's
checks); `plan` prints where every model rank would run on a cluster of `--nodes` x `--gpus-per-node` without
starting Ray.
`deploy` registers the config as a Prefect deployment (the UI's run form is the config) that a process
worker runs, `serve` runs one from this process, `server` keeps the local Prefect server and its UI up.
`reward-server` serves a reward model over HTTP to the runs that name it in `models.<name>.args_dict.remote_url`
(`chatlearn.models.hf.reward_server`).
`export` writes a checkpoint iteration of a run as a Hugging Face model (LoRA merged) or a peft adapter, with a
model card (`chatlearn.models.hf.export`). `trace RUN_DIR` prints or writes the samples a run kept
(`runtime.trace_samples`: `chatlearn.runtime.records.traces`).

The commands import torch, Ray and Prefect only when they run, so `chatlearn config` answers at once.
"""

import argparse
import contextlib
import json
import os
import re
import signal
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from chatlearn.checkpoint.run_config import RunDirConflict, inspect_run_dir
from chatlearn.config import ChatLearnConfig, ConfigError, ConfigWarning, EngineChecks, load_config
from chatlearn.config.engine_checks import engine_name
from chatlearn.config.engines import engine_class
from chatlearn.data.prompts import DataError
from chatlearn.runtime.calls.stopping import stop_on_signals
from chatlearn.runtime.cluster.dlc import DLCNode, dlc_head, dlc_node, serve_as_worker
from chatlearn.runtime.cluster.placement import PlacementError, plan_placement, uniform_cluster
from chatlearn.runtime.records.console import run_log
from chatlearn.runtime.records.run_lock import lock_run_dir
from chatlearn.utils.devices import fake_gpus
from chatlearn.utils.errors import RunCrashed, UserError, find_user_error


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
    names = [r for r in engine_class(engine_name(cfg)).model_roles() or () if r in cfg.models]
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


def cmd_eval(items: list[str], verbose: bool = False) -> int:
    # lazy: torch, Ray and Prefect load only for the commands that run something (see the module docstring)
    from chatlearn.runtime.cluster.launch import check_local_placement
    from chatlearn.runtime.engine import engine_of, resolve_engine
    from chatlearn.runtime.prepared import prepare_run
    from chatlearn.runtime.records.prefect_server import local_prefect_api

    cfg = _load(items, engine="eval")
    resolved = resolve_engine(cfg, engine="eval")
    check_local_placement(cfg, list(resolved.modules))  # a layout this machine cannot hold: one line, now
    # model paths, data, prompt lengths: errors before the Prefect server or Ray start
    prepared = prepare_run(cfg, resolved=resolved)
    # eval writes run_dir/eval.json: one command per run directory, as for train (RunError naming the holder)
    with lock_run_dir(cfg.runtime.run_dir), run_log(cfg.runtime.run_dir, verbose), \
            local_prefect_api(announce=_announce):
        metrics = engine_of(prepared.engine).eval(prepared)
    print(json.dumps(metrics, indent=1, default=str))
    return 0


def cmd_train(items: list[str], verbose: bool = False) -> int:
    # lazy: torch, Ray and Prefect load only for the commands that run something (see the module docstring)
    from chatlearn.checkpoint.resume import checkpoint_dirs
    from chatlearn.runtime.cluster.launch import check_local_placement
    from chatlearn.runtime.engine import engine_of, resolve_engine
    from chatlearn.runtime.prepared import prepare_run
    from chatlearn.runtime.records.prefect_server import local_prefect_api
    from chatlearn.runtime.records.reporting import summary_text

    cfg = _load(items)
    node = dlc_node(cfg.runtime_env.platform)
    if node is not None and "RAY_AUTH_MODE" not in os.environ and "RAY_AUTH_TOKEN" not in os.environ:
        # a DLC job's nodes share no token file: Ray's default would give the head a token its workers lack
        _announce("DLC: Ray token authentication is off (set RAY_AUTH_MODE=token and the same RAY_AUTH_TOKEN "
                  "on every node of the job to turn it on)")
        os.environ["RAY_AUTH_MODE"] = "disabled"
    if node is not None and node.rank > 0:  # a DLC worker node: serve Ray until the head is gone
        return serve_as_worker(node, fake_gpus() or None)
    state = inspect_run_dir(cfg)  # a finished run, or one started with another config (RunDirConflict)
    if state.complete:
        print(f"chatlearn: {state.complete_message(cfg)}", file=sys.stderr)
        return 0
    resolved = resolve_engine(cfg)
    if node is None:  # a DLC job's placement needs its nodes: checked against them once they joined
        check_local_placement(cfg, list(resolved.modules))  # a layout this machine cannot hold: said now
    # model paths, data, prompt lengths: errors before the Prefect server or Ray start
    prepared = prepare_run(cfg, resolved=resolved)
    # one run per run directory, taken before the Prefect server starts (the train flow re-enters it in this
    # process); the run and checkpoint directories are checked writable here too
    # run_log: the run's log file; a RunError's tracebacks go there, not to the terminal
    with lock_run_dir(cfg.runtime.run_dir, checkpoint_dirs(cfg)), run_log(cfg.runtime.run_dir, verbose), \
            _dlc_head(node), local_prefect_api(announce=_announce):
        result = engine_of(prepared.engine).learn(prepared)
    if result.get("summary"):
        print(summary_text(result), file=sys.stderr)
    else:  # a run that was already complete: its summary.json predates the summary
        print(f"run directory: {cfg.runtime.run_dir}", file=sys.stderr)
        if result.get("final_policy"):
            print(f"final policy: {result['final_policy']}", file=sys.stderr)
    return 0


def cmd_server(host: str, port: int | None) -> int:
    """`server`: basic authentication when PREFECT_SERVER_API_AUTH_STRING (Prefect's server setting) is set,
    required on any address but the loopback one."""
    # lazy: Prefect loads only when a command needs it
    from prefect.settings import PREFECT_SERVER_API_AUTH_STRING

    from chatlearn.runtime.records.prefect_server import LOOPBACK, ServerSettings, serve_forever  # lazy, as above

    auth = PREFECT_SERVER_API_AUTH_STRING.value()
    auth = auth.get_secret_value() if hasattr(auth, "get_secret_value") else auth
    if auth is not None and (":" not in auth or not all(auth.split(":", 1))):
        print("chatlearn: error: PREFECT_SERVER_API_AUTH_STRING must be user:password (it is not shown)",
              file=sys.stderr)
        return 2
    if host not in (LOOPBACK, "localhost") and not auth:
        print(f"chatlearn: error: --host {host} would open the Prefect API to every machine that reaches this "
              "one, without authentication: set PREFECT_SERVER_API_AUTH_STRING=user:password (and "
              "PREFECT_API_AUTH_STRING to the same on every client: runs, workers, `prefect` commands)",
              file=sys.stderr)
        return 2
    if auth:  # this process is a client of its server too (it may start it again)
        os.environ["PREFECT_API_AUTH_STRING"] = auth
    serve_forever(announce=_announce, server=ServerSettings(host, port, auth))
    return 0


def cmd_reward_server(model_path: str, host: str, port: int, batch_size: int, dtype: str, device: str | None) -> int:
    """`reward-server`: load the reward model once and serve it until Ctrl-C / SIGTERM (exit 0)."""
    try:
        # lazy: torch and transformers load only for the commands that run something (see the module docstring)
        from chatlearn.models.hf.reward_server import serve
    except KeyboardInterrupt:  # Ctrl-C while torch loads: nothing was served, nothing to resume
        print("chatlearn reward-server: stopped by SIGINT", file=sys.stderr)
        return 0
    serve(model_path, host, port, batch_size, dtype, device)
    return 0


def cmd_export(run_dir: str, out: str, iteration: int | None, to: str, model: str | None, force: bool,
               model_path: str | None) -> int:
    """`export`: one checkpoint iteration of a run as a Hugging Face model or a peft adapter, with a model card."""
    # lazy: torch, transformers and peft load only for the commands that run something (see the module docstring)
    from chatlearn.models.hf.export import export_checkpoint
    from chatlearn.models.hf.tiny import progress_bars_off

    with progress_bars_off():  # one line of output, not transformers' loading bars
        export_checkpoint(run_dir, out, iteration=iteration, to=to, model=model, force=force, model_path=model_path,
                          announce=print)
    return 0


# what `chatlearn trace` prints of each sample, when these columns are there (--columns picks others)
TRACE_COLUMNS = ("episode", "sample_id", "group_id", "reward", "advantage", "policy_version", "staleness", "prompt",
                 "response")


def cmd_trace(run_dir: str, episode: int | None, where: str | None, columns: str | None, out: str | None,
              limit: int, sort: str | None = None, reverse: bool = False) -> int:
    from chatlearn.runtime.records.traces import TRACE_DIR, read_traces  # lazy, as above

    if not os.path.isdir(run_dir):
        raise UserError(f"{run_dir} is not a run directory")
    table = read_traces(run_dir, episode)
    if table.empty:
        which = f" of episode {episode}" if episode is not None else ""
        raise UserError(f"{run_dir} keeps no samples{which} (its {TRACE_DIR}/ folder: runtime.trace_samples)")
    if where:
        try:
            table = table.query(where)
        except Exception as exc:  # pandas' own error names what it could not read
            raise UserError(f"--where {where!r}: {type(exc).__name__}: {exc} (columns: "
                            f"{', '.join(table.columns)})") from exc
    if sort:
        if sort not in table.columns:
            raise UserError(f"--sort: no column {sort} (columns: {', '.join(table.columns)})")
        table = table.sort_values(sort, ascending=not reverse, kind="stable")
    if columns:
        wanted = [c.strip() for c in columns.split(",") if c.strip()]
        missing = [c for c in wanted if c not in table.columns]
        if missing:
            raise UserError(f"--columns: no column {', '.join(missing)} (columns: {', '.join(table.columns)})")
        table = table[wanted]
    if out:
        suffix = os.path.splitext(out)[1]
        writers = {".parquet": table.to_parquet, ".csv": lambda p: table.to_csv(p, index=False),
                   ".jsonl": lambda p: table.to_json(p, orient="records", lines=True)}
        if suffix not in writers:
            raise UserError(f"--out {out}: .parquet, .csv or .jsonl")
        writers[suffix](out)
        print(f"{len(table)} samples -> {out}", file=sys.stderr)
        return 0
    shown = table if columns else table[[c for c in TRACE_COLUMNS if c in table.columns]]
    with _pandas_width():
        print(shown.head(limit).to_string(index=False, max_colwidth=60))
    if len(table) > limit:
        print(f"({len(table)} samples; the first {limit} shown: --limit, or --out FILE for all)", file=sys.stderr)
    return 0


@contextlib.contextmanager
def _pandas_width() -> Iterator[None]:
    import pandas as pd  # lazy, as above

    with pd.option_context("display.width", 200, "display.max_columns", None):
        yield


def cmd_deploy(items: list[str], how: str, name: str | None, cron: str | None, on_overlap: str | None,
               evaluate: bool, work_pool: str | None, alert_on: list[str] | None = None) -> int:
    """`deploy`: register on the work pool and exit; `serve`: register and run the deployment here."""
    # the flags are the config's `deployment` section, validated with it (a bad cron names deployment.cron)
    flags = {"name": name, "cron": cron, "on_overlap": on_overlap, "work_pool": work_pool}
    items = items + [f"deployment.{key}={value}" for key, value in flags.items() if value is not None]
    if alert_on:  # the runs check them (runtime.alerts); an automation per alert pauses the deployment
        items.append(f"runtime.alerts={json.dumps(alert_on)}")
    cfg = _load(items)
    if evaluate:
        _load(items, engine="eval")  # the eval deployment's checks too, before anything is registered
    # lazy: Prefect loads only for the commands that run something (the command sits above flows/, see
    # tests/test_layers.py)
    from chatlearn.runtime.records.prefect_server import local_prefect_api
    from flows import deployments

    spec = deployments.deployment_spec(cfg)
    said: list[str] = []
    with local_prefect_api(announce=lambda msg: (said.append(msg), _announce(msg))) as url:
        ui = url.removesuffix("/api")
        if how == "serve":
            _announce(f"serving {deployments.TRAIN_FLOW}/{spec.name}"
                      + (f" on schedule '{spec.cron}'" if spec.cron else "") + "; run it from the UI: "
                      f"{ui}/deployments (Ctrl-C stops serving and pauses its schedule)")
            deployments.serve(cfg, spec, evaluate)
            return 0
        ids, open_variables = deployments.deploy(cfg, spec, evaluate)
    for full_name, dep_id in ids.items():
        print(f"deployed {full_name}: {ui}/deployments/deployment/{dep_id}")
    print("pinned: the engine, hooks, module classes and runtime_env of this config; no run can change them "
          "(deploy again to)")
    if open_variables:
        _announce(f"chatlearn: warning: work pool {spec.work_pool!r} lets every run set the job variables "
                  f"{', '.join(open_variables)}, so whoever can start a run can run any command on the worker; "
                  "a pool chatlearn deploy creates has none (--work-pool NEW, or recreate it with "
                  "`prefect work-pool create NAME --type process --overwrite --base-job-template "
                  "deployments/work-pool.json`)")
    schedule = f"scheduled '{spec.cron}' ({spec.timezone or 'UTC'})" if spec.cron else "no schedule"
    print(f"{schedule}; overlapping runs: {spec.on_overlap}; work pool: {spec.work_pool}")
    print(f"runs need a worker: PREFECT_API_URL={url} prefect worker start --pool {spec.work_pool}")
    if any("(started local server)" in msg for msg in said):
        _announce("note: no Prefect server was running, so the one started here stopped again; keep one up "
                  "with `chatlearn server` (or set PREFECT_API_URL) for the UI, schedules and the worker")
    return 0


def _stopped(signame: str) -> int:
    print(f"chatlearn: stopped by {signame}; re-run the same command to resume from the last checkpoint",
          file=sys.stderr)
    return 128 + int(getattr(signal, signame, signal.SIGINT))


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
    # Ray's token authentication: a local run turns it on (chatlearn.runtime.cluster.launch.loopback_only); joining
    # RAY_ADDRESS follows the cluster (RAY_AUTH_MODE / RAY_AUTH_TOKEN as the user set them, README)
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    previous = warnings.showwarning
    warnings.showwarning = _config_warnings_as_lines(previous)
    try:
        return _main(argv)
    finally:
        warnings.showwarning = previous


_COMMANDS: dict[str, tuple[str, str]] = {
    # name: (one-line help, example)
    "train": ("train with a config (default: the embedded tiny PPO run); re-running resumes from the last "
              "checkpoint", "chatlearn train grpo runtime.num_episode=3"),
    "eval": ("evaluate a policy on the config's eval set",
             "chatlearn eval models.policy.args_dict.model_path=output/default/final/policy"),
    "config": ("print a config resolved, as JSON (as ChatLearn's loader resolves it)",
               "chatlearn config dpo --check runtime.num_episode=2"),
    "plan": ("print where every model rank would run on a cluster, as JSON (no Ray started)",
             "chatlearn plan default --nodes 2 --gpus-per-node 8"),
    "deploy": ("register a Prefect deployment of the config on a process work pool: the UI's run form is the "
               "config; a worker runs it (prefect worker start --pool chatlearn)",
               'chatlearn deploy grpo --cron "0 3 * * *" --name nightly-grpo --evaluate'),
    "serve": ("serve a deployment of the config from this process (Prefect's flow.serve: no work pool, no "
              "worker) until Ctrl-C", 'chatlearn serve default --cron "*/30 * * * *"'),
    "server": ("start the local Prefect server the way `train` does and keep it up until Ctrl-C; prints the UI "
               "address and the PREFECT_API_URL for workers; basic authentication with "
               "PREFECT_SERVER_API_AUTH_STRING=user:password",
               "chatlearn server --host 0.0.0.0 --port 4200   # PREFECT_SERVER_API_AUTH_STRING=user:password exported"),
    "reward-server": ("serve a reward model (a Hugging Face sequence-classification model, one label) over HTTP "
                      "until Ctrl-C, for runs that set models.<name>.args_dict.remote_url to its address; prints "
                      "that address first",
                      "chatlearn reward-server output/my-reward-model --port 8765   # remote_url: "
                      "http://127.0.0.1:8765"),
    "trace": ("print or write the samples a run kept (runtime.trace_samples): prompt, response, rewards, "
              "advantage, the weights version that generated each, log-probs",
              "chatlearn trace output/grpo --episode 12 --sort advantage --reverse --limit 5"),
    "export": ("write a checkpoint iteration of a run as a Hugging Face model (LoRA merged into the base) or, for "
               "a LoRA run, as a peft adapter, with the tokenizer and a model card (README.md: the config and that "
               "iteration's metrics)",
               "chatlearn export output/online_dpo --iteration 4 --to peft output/online_dpo-iter4-adapter"),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chatlearn", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_, example) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_, epilog=f"example:\n  {example}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == "server":
            p.add_argument("--host", default="127.0.0.1",
                           help="address to listen on (default 127.0.0.1; 0.0.0.0: every address, for a cluster); "
                                "any but 127.0.0.1 needs PREFECT_SERVER_API_AUTH_STRING=user:password, the basic "
                                "authentication every client then sends as PREFECT_API_AUTH_STRING")
            p.add_argument("--port", type=int, default=None, help="port (default: a free one)")
            continue
        if name == "reward-server":
            p.add_argument("model_path", metavar="MODEL_PATH",
                           help="local Hugging Face model directory of the reward model (loaded as "
                                "AutoModelForSequenceClassification with num_labels=1, as ModelReward loads it)")
            p.add_argument("--host", default="127.0.0.1",
                           help="address to listen on (default 127.0.0.1; 0.0.0.0: every address, for a cluster; "
                                "there is no authentication)")
            p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0: a free one, printed)")
            p.add_argument("--batch-size", type=int, default=16,
                           help="texts per forward pass (default 16); a request of more is scored in batches")
            p.add_argument("--dtype", default="float32", help="torch dtype of the weights (default float32)")
            p.add_argument("--device", default=None,
                           help="torch device (default: cuda when there is a GPU, else cpu)")
            continue
        if name == "export":
            p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (output_dir/exp_name)")
            p.add_argument("out", metavar="OUT", help="the directory to write (created; written next to it and "
                                                      "renamed into place when complete)")
            p.add_argument("--iteration", type=int, default=None,
                           help="trainer iteration of the checkpoint (RUN_DIR/checkpoints/MODEL/iter_N; default: "
                                "the latest)")
            p.add_argument("--to", choices=["hf", "peft"], default="hf",
                           help="hf (default): a model AutoModelForCausalLM.from_pretrained loads, a LoRA run's "
                                "adapters merged; peft: a LoRA run's adapter for PeftModel.from_pretrained(base, OUT)")
            p.add_argument("--model", default=None,
                           help="which trained model (default: ppo_policy, the policy trainer, or the run's only "
                                "checkpointed model)")
            p.add_argument("--force", action="store_true", help="replace OUT when it exists and is not empty")
            p.add_argument("--model-path", default=None,
                           help="the model directory the config.json and tokenizer come from (default: the run's "
                                "models.MODEL.args_dict.model_path, else RUN_DIR/final/policy); the weights always "
                                "come from the checkpoint")
            continue
        if name == "trace":
            p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (output_dir/exp_name)")
            p.add_argument("--episode", type=int, default=None, help="that episode only (counted from 1)")
            p.add_argument("--where", default=None,
                           help="rows where this pandas query holds, e.g. \"reward > 0.5 and staleness == 0\"")
            p.add_argument("--columns", default=None, help="these columns, comma-separated (default: ids, reward, "
                                                           "advantage, version, prompt and response)")
            p.add_argument("--out", default=None, help="write every matching row, all columns unless --columns, "
                                                       "to a .parquet, .csv or .jsonl file")
            p.add_argument("--sort", default=None, metavar="COLUMN", help="rows in the order of this column")
            p.add_argument("--reverse", action="store_true", help="with --sort: largest first")
            p.add_argument("--limit", type=int, default=20, help="rows printed (default 20)")
            continue
        if name == "plan":
            p.add_argument("--nodes", type=int, default=1, help="nodes in the cluster (default 1)")
            p.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (default 0)")
            p.add_argument("--cpus-per-node", type=float, default=None,
                           help="CPUs per node (default: not limited)")
        if name == "config":
            p.add_argument("--check", action="store_true",
                           help="also run the checks `chatlearn train` runs (engine models, module args, hooks, "
                                "fields not supported yet)")
        if name in ("deploy", "serve"):
            p.add_argument("--name", help="deployment name (default: the config's deployment.name, else "
                                          "runtime.exp_name)")
            p.add_argument("--cron", help="cron schedule of runs, e.g. '0 3 * * *' (default: the config's "
                                          "deployment.cron, else no schedule)")
            p.add_argument("--on-overlap", choices=["skip", "queue"], default=None,
                           help="a run that finds the deployment's previous run still going: skip (cancel it) "
                                "or queue (wait); default: the config's deployment.on_overlap (skip)")
            p.add_argument("--evaluate", action="store_true",
                           help="also register an eval deployment that an automation starts when a run of this "
                                "deployment completes, evaluating its final/policy")
            p.add_argument("--alert-on", action="append", default=None, metavar="EXPR",
                           help="an alert on each episode's metrics, 'METRIC OP NUMBER [for N episodes]', e.g. "
                                "'reward_mean < 0.1 for 3 episodes' (runtime.alerts; may be given again): the runs "
                                "emit the Prefect event chatlearn.alert when it holds, and an automation pauses the "
                                "deployment")
        if name in ("train", "eval"):
            p.add_argument("--verbose", action="store_true",
                           help="also show Prefect's log lines (each flow and task run beginning and finishing) on "
                                "the terminal; they always go to the UI and run_dir/chatlearn.log")
        if name == "train":
            p.add_argument("--resume-with-changes", action="store_true",
                           help="continue the run in its run directory although this config differs from the one "
                                "it was started with in fields that change results (otherwise refused, naming "
                                "them); the run's run_config.json records the change "
                                "(runtime.resume_with_changes=true)")
        if name == "deploy":
            p.add_argument("--work-pool", default=None,
                           help="process work pool (created if missing; default: the config's "
                                "deployment.work_pool, 'chatlearn')")
        p.add_argument("args", nargs="*", metavar="CONFIG|key=value",
                       help="a YAML file or a packaged config's name (default, grpo, dpo, online_dpo, rloo, "
                            "reinforce_pp, dapo, ...; default: default), then dotted overrides")
    return parser


def _main(argv: list[str] | None) -> int:
    parser = _parser()
    # flags may come before or after the config and its overrides (argparse stops at the first positional)
    ns, extra = parser.parse_known_args(argv)
    unknown = [e for e in extra if e.startswith("-") or not hasattr(ns, "args")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        ns.args = [*ns.args, *extra]
    try:
        if ns.command == "config":
            return cmd_config(ns.args, ns.check)
        if ns.command == "plan":
            return cmd_plan(ns.args, ns.nodes, ns.gpus_per_node, ns.cpus_per_node)
        if ns.command == "server":
            return cmd_server(ns.host, ns.port)
        if ns.command == "reward-server":
            return cmd_reward_server(ns.model_path, ns.host, ns.port, ns.batch_size, ns.dtype, ns.device)
        if ns.command == "trace":
            return cmd_trace(ns.run_dir, ns.episode, ns.where, ns.columns, ns.out, ns.limit, ns.sort, ns.reverse)
        if ns.command == "export":
            return cmd_export(ns.run_dir, ns.out, ns.iteration, ns.to, ns.model, ns.force, ns.model_path)
        if ns.command in ("deploy", "serve"):
            return cmd_deploy(ns.args, ns.command, ns.name, ns.cron, ns.on_overlap, ns.evaluate,
                              getattr(ns, "work_pool", None), ns.alert_on)
        if ns.command == "train" and ns.resume_with_changes:
            ns.args = [*ns.args, "runtime.resume_with_changes=true"]
        # SIGTERM / Ctrl-C stop within seconds from here on, start-up included, with one line, leaving nothing of
        # the run running (the Prefect server it started, Ray, the model processes: chatlearn.runtime.calls.stopping)
        with stop_on_signals():
            return {"train": cmd_train, "eval": cmd_eval}[ns.command](ns.args, verbose=ns.verbose)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (chatlearn.runtime.calls.stopping.Stopped)
        return _stopped(getattr(exc, "signame", "SIGINT"))
    except RunCrashed as exc:  # e.g. the Ray head of the cluster the run joined went away (runtime.cluster.head)
        print(f"chatlearn: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # a stop's own failures on the way out arrive as Stopped (stop_on_signals)
        # an error meant for the user (a config, data, a placement, a user hook, a NaN, a write that failed, a
        # run directory in use), itself or inside Ray's RayTaskError (whose own str() is the remote traceback)
        # or an exception chain, whichever layer raised it: its lines without a traceback (that is in
        # run_dir/chatlearn.log, chatlearn.runtime.records.console); anything else is a bug of ours and keeps its
        # traceback
        err = find_user_error(exc)
        if err is None:
            raise
        return _report(err)


def _report(err: UserError) -> int:
    """Print a user error as its line(s); the exit status: 2 for what was refused before anything ran."""
    if isinstance(err, ConfigError):
        print(f"chatlearn: invalid config ({len(err.problems)} problem(s)):", file=sys.stderr)
        for problem in err.problems:
            print(f"  - {problem}", file=sys.stderr)
        return 2
    if isinstance(err, PlacementError):
        print(f"chatlearn: {err}", file=sys.stderr)
        return 2
    if isinstance(err, DataError):
        print(f"chatlearn: bad data: {err}", file=sys.stderr)
        return 2
    print(f"chatlearn: error: {err}", file=sys.stderr)
    return 2 if isinstance(err, RunDirConflict) else 1


if __name__ == "__main__":
    sys.exit(main())
