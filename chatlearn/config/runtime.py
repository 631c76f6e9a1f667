"""``runtime_env`` and ``runtime``: ChatLearn 1.0.2's ``RuntimeEnvConfig`` and ``RuntimeConfig``, field for
field, plus the runtime keys ChatLearn reads as user extras (``seed``, ``data_shuffle``, ...), declared here
with their defaults so they are typed and documented like the rest."""

import math
import os
from typing import Any

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from chatlearn.config.alerts import parse_alert
from chatlearn.config.sections import Section

__all__ = [
    "CPU_SCHEDULE_STRATEGIES",
    "PARAM_SYNC_COMM_TYPES",
    "AgentConfig",
    "PartialRolloutConfig",
    "STREAM_DATA_LOADER_TYPES",
    "RuntimeConfig",
    "RuntimeEnvConfig",
]

STREAM_DATA_LOADER_TYPES = ("fixed", "dynamic")
PARAM_SYNC_COMM_TYPES = ("broadcast", "p2p")
CPU_SCHEDULE_STRATEGIES = ("PACK", "SPREAD")
TASK_TYPES = ("chat", "agent")
WANDB_RESUME = ("allow", "must", "never", "auto")


class PartialRolloutConfig(Section):
    """``runtime.partial_rollout_manager_config`` (ChatLearn HEAD's PartialRolloutManagerConfig, same names and
    defaults except ``mini_response_per_prompt``: ChatLearn's 16 is for its 32 responses a prompt, so the default
    here follows the group size, ``num_inference_per_prompt - 1``: a group trains whole)."""

    model_config = ConfigDict(extra="forbid")

    max_rollout_round: int = Field(default=2, ge=1, description="the most rounds (episodes) one response spans")
    rollout_ratio: list[float] = Field(
        default_factory=lambda: [0.5, 0.5],
        description="round i generates at most max_new_tokens * rollout_ratio[i] new tokens; one ratio per round, "
        "summing to 1 (rounded so the rounds add up to max_new_tokens exactly)")
    mini_response_per_prompt: int | None = Field(
        default=None, ge=0,
        description="a prompt's finished responses move to training once more than this many of its group are "
        "finished, and each later one as it finishes (ChatLearn's rule; each part's advantages are normalised over "
        "that part); default num_inference_per_prompt - 1: a prompt's group trains whole, normalised over all its "
        "responses")

    @model_validator(mode="after")
    def _ratios(self) -> "PartialRolloutConfig":
        # ChatLearn's two checks; its sum test is exact float equality, which refuses [0.1, 0.2, 0.7]
        if len(self.rollout_ratio) != self.max_rollout_round:
            raise ValueError(f"rollout_ratio has {len(self.rollout_ratio)} ratios but max_rollout_round is "
                             f"{self.max_rollout_round}: one ratio per round")
        if any(r <= 0 for r in self.rollout_ratio):
            raise ValueError(f"rollout_ratio {self.rollout_ratio}: every round's ratio must be > 0")
        if not math.isclose(sum(self.rollout_ratio), 1.0, abs_tol=1e-6):
            raise ValueError(f"rollout_ratio {self.rollout_ratio} sums to {sum(self.rollout_ratio):g}; the ratios "
                             "of the rounds must sum to 1")
        return self

    def round_budgets(self, max_new_tokens: int) -> list[int]:
        """Each round's most new tokens: ``max_new_tokens * rollout_ratio[i]``, rounded on the running sum so the
        rounds add up to ``max_new_tokens`` exactly (ChatLearn's ``int()`` per round can lose tokens: 0.3 of 16
        is 4, 0.7 is 11, 15 in all)."""
        edges = [0]
        total = 0.0
        for ratio in self.rollout_ratio:
            total += ratio
            edges.append(min(max_new_tokens, round(total * max_new_tokens)))
        edges[-1] = max_new_tokens
        return [b - a for a, b in zip(edges, edges[1:], strict=False)]


class AgentConfig(Section):
    """``runtime.agent``: multi-turn rollouts (``runtime.task_type: agent``). The policy answers, the environment
    (one instance per sample) reads the answer and returns an observation, the policy answers again, until the
    environment says done, ``max_turns`` answers were given, or a whole turn no longer fits ``max_total_tokens``
    (`chatlearn.runtime.rollout.multi_turn`)."""

    model_config = ConfigDict(extra="forbid")

    env: str | None = Field(default=None, description="the environment class, 'package.module:Class' (or "
                            "'file.py:Class' next to the config): reset(sample) and step(action) -> observation, "
                            "reward, done, info (chatlearn.envs.Environment)")
    env_args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the environment's "
                                     "constructor")
    max_turns: int = Field(default=4, ge=1, description="the most policy answers (assistant turns) of one "
                           "conversation")
    max_total_tokens: int = Field(default=512, gt=0, description="the most tokens after the prompt: answers and "
                                  "observations; a turn starts only when a whole answer (max_new_tokens) still fits")
    num_cpus_per_task: float = Field(default=0.5, gt=0, description="CPUs of each environment-step task (one per "
                                     "batch and turn, a Prefect task on Ray)")
    timeout_s: float = Field(default=60.0, gt=0, description="seconds one environment-step task may take")
    retries: int = Field(default=0, ge=0, description="Prefect retries of an environment-step task that raised "
                         "(each retry starts from the environments as they were before the step)")


class LogArgsConfig(Section):
    """``runtime.log_args_dict``: the experiment trackers every per-episode metric also goes to (ChatLearn's
    LogConfig names, plus MLflow's). Directories default to the run directory's ``tensorboard`` and ``wandb``;
    a tracker that is enabled but not installed, or fails, costs the run one warning, never the training
    (:mod:`chatlearn.runtime.records.trackers`)."""

    model_config = ConfigDict(extra="forbid")

    log_dir: str | None = Field(default=None, description="where tracker files go by default (default: the run "
                                "directory)")
    enable_tensorboard: bool = Field(default=False, description="write TensorBoard event files")
    tensorboard_dir: str | None = Field(default=None, description="TensorBoard log dir (default log_dir/tensorboard)")
    enable_wandb: bool = Field(default=False, description="log to Weights & Biases (WANDB_MODE=offline: local "
                               "files only, `wandb sync` later)")
    wandb_dir: str | None = Field(default=None, description="wandb's local files (default log_dir/wandb)")
    wandb_project: str | None = Field(default=None, description="wandb project (default: the exp_name)")
    wandb_id: str | None = Field(default=None, description="wandb run id (default: a new id, kept in "
                                 "run_dir/trackers.json so a resumed run continues the same wandb run)")
    wandb_name: str | None = Field(default=None, description="wandb run name (default: the exp_name)")
    wandb_resume: str = Field(default="allow", description="wandb.init's resume: allow, must, never or auto")
    enable_mlflow: bool = Field(default=False, description="log to MLflow")
    mlflow_tracking_uri: str | None = Field(default=None, description="MLflow tracking server URI (default: "
                                            "MLFLOW_TRACKING_URI, else MLflow's own default)")
    mlflow_experiment_name: str | None = Field(default=None, description="MLflow experiment (default: the exp_name)")

    @field_validator("wandb_resume")
    @classmethod
    def _resume_choice(cls, value: str) -> str:
        if value not in WANDB_RESUME:
            raise ValueError(f"{value!r} is not one of {list(WANDB_RESUME)} (wandb.init's resume)")
        return value

    @property
    def enabled(self) -> list[str]:
        """The trackers this config turns on, by name: each ``enable_<name>`` field names a tracker of
        ``chatlearn.runtime.records.trackers.TRACKERS`` (its tests keep the two in step)."""
        return [f.removeprefix("enable_") for f in type(self).model_fields
                if f.startswith("enable_") and getattr(self, f)]


class RuntimeEnvConfig(Section):
    """Runtime env config, you can refer https://docs.ray.io/en/latest/ray-core/handling-dependencies.html
    for more information. Unknown keys are kept and readable with ``get(key)``."""

    model_config = ConfigDict(extra="allow")

    pip: list[str] = Field(default_factory=list, description="pip install packages")
    py_modules: list[str] = Field(default_factory=list, description="python modules")
    working_dir: str = Field(
        default_factory=os.getcwd, description="working directory (default: the current directory)"
    )
    platform: str = Field(default="", description="platform, e.g., DLC")
    excludes: list[str] = Field(default_factory=list, description="excludes files from packaging")


class RuntimeConfig(Section):
    """Training related configs. Unknown keys are kept and readable with ``get(key)``.

    After validation ``train_global_batch_size`` is never None (defaults to ``train_micro_batch_size``) and
    ``output_dir`` is the run directory ``output_dir/exp_name`` (see :attr:`run_dir`).
    """

    model_config = ConfigDict(extra="allow")

    num_episode: int = Field(
        default=5000,
        description="[required] number of episodes. One episode includes a inference and training loop.",
    )
    sample_per_episode: int = Field(default=1000, description="[required] number of samples per episode.")
    num_training_epoch: int = Field(
        default=1, description="[optional] number of training epoch per episode. default set to 1."
    )
    generation_batch_size: int = Field(default=2, description="[required] generation(inference) batch size.")
    train_micro_batch_size: int = Field(default=2, description="[required] training micro batch size.")
    train_global_batch_size: int | None = Field(
        default=None,
        description="[required] training global batch size. None: set to train_micro_batch_size; "
        "must be a multiple of train_micro_batch_size.",
    )
    save_episode_interval: int | None = Field(
        default=None, description="[required] save checkpoint per save_episode_interval episodes."
    )
    log_interval: int = Field(
        default=1, description="[optional] log time and memory per log_interval iterations."
    )
    data_path: str | list[str] | None = Field(
        default=None, description="[required] data_path for dataset (a path, or a list of paths)"
    )
    colocation: list[str] = Field(
        default_factory=list,
        description='[optional] colocate models into the same device: a list of groups, each "a,b,c" '
        "(a group may also be given as a list of model names)",
    )
    eval_episode_interval: int = Field(
        default=0, description="[optional] eval every N episode, if 0, will not eval"
    )
    enable_resume_training: bool = Field(
        default=True, description="[optional] enable resume training when data checkpoint is set"
    )
    data_checkpoint_path: str | None = Field(default=None, description="[optional] checkpoint for dataloader")
    max_data_ckpt_nums: int | None = Field(default=None, description="[optional] max data checkpoint nums")
    load_data_checkpoint_iteration: int | None = Field(
        default=None, description="[optional] load data checkpoint from iteration"
    )
    stream_data_loader_type: str = Field(
        default="fixed", description='[optional] stream_data_loader type, ["fixed", "dynamic"]'
    )
    debug: bool = Field(default=False, description="private")
    nsys: bool = Field(default=False, description="enable nsys nvtx")
    profiler_dir: str | None = Field(default=None, description="profiler dir")
    coalesce_param: bool = Field(default=True, description="coalesce parameters in model sync")
    coalesced_buffer_mb: int = Field(default=100, description="coalesce_buffer size in mb")
    concurrent_comm: bool = Field(default=True, description="concurrent parameter sync")
    param_sync_comm_type: str = Field(
        default="broadcast", description="parameter sync communication type, broadcast/p2p"
    )
    param_sync_max_workers: int | None = Field(default=None, description="parameter sync max workers")
    max_relay_episode: int = Field(
        default=0,
        description="max number of relay episodes, if max_relay_episode is set to -1, then relay all "
        "episodes if max_relay_episode is set to 0, then relay is disabled (any negative value: all)",
    )
    relay_episode_offset: int = Field(default=0, description="relay after n episodes")
    consumed_samples: int = Field(default=0, description="consumed samples")
    concurrent_setup: bool = Field(default=False, description="concurrent model setup")
    bucket_size_mb_in_memory_manager: int = Field(
        default=1024, description="bucket size in the memory manager to reduce peak memory"
    )
    free_sync_collective_group: bool = Field(
        default=False,
        description="free collective group after parameter synchronization and rebuild before next "
        "synchronization",
    )
    cpu_schedule_strategy: str = Field(
        default="SPREAD",
        description="[optional] cpu only model schedule policy, PACK or SPREAD PACK: All provided bundles "
        "are packed onto a single node on a best-effort basis. SPREAD: Each bundle is spread onto separate "
        "nodes on a best-effort basis.",
    )
    exp_name: str = Field(default="CHATLEARN", description="exp name for each run")
    output_dir: str = Field(
        default="./",
        description="output dir; after loading it is output_dir/exp_name (exp_name appended once)",
    )
    # -- keys ChatLearn reads with runtime_args.get(...) or added after 1.0.2, declared with their defaults --
    seed: int = Field(default=42, description="the run seed: sampling, data shuffling, init")
    engine: str = Field(
        default="rlhf", description="the engine `chatlearn train` builds when the config names none in code"
    )
    rollout_engine: str = Field(
        default="hf",
        description="generation backend of the inference policy (ChatLearn HEAD's key): 'hf', one Hugging Face "
        "generate per batch (every row runs until the batch's longest response ends); 'continuous', continuous "
        "batching (a finished response frees its slot for the next prompt: policy args_dict.max_num_seqs); "
        "'vllm', vLLM in the policy's process (the `vllm` extra; the CPU build here); 'sglang' needs a GPU build "
        "and is not supported yet",
    )
    max_staleness: int = Field(
        default=0, ge=0,
        description="pipelined episodes (bounded staleness): the generation of episode N+1 (up to N+k) runs while "
        "episode N scores and trains, on the policy weights of k episodes before (0: each episode generates on "
        "the weights its previous episode trained, one stage after another). Needs the generating model in its "
        "own processes (not in a runtime.colocation group); each episode logs staleness_mean/max and dropped_stale",
    )
    use_partial_rollout: bool = Field(
        default=False, description="partial rollouts (ChatLearn HEAD): a response is generated over up to "
        "partial_rollout_manager_config.max_rollout_round episodes, at most max_new_tokens * rollout_ratio[i] new "
        "tokens in round i; an unfinished one is continued in the next episode on the newer weights, and a "
        "prompt's group trains once all its responses are finished. Needs stream_data_loader_type: dynamic",
    )
    task_type: str = Field(
        default="chat", description="ChatLearn HEAD's key: 'chat', one prompt and one response; 'agent', multi-turn "
        "rollouts with an environment (runtime.agent): the policy's answers and the environment's observations "
        "alternate, the observations' tokens kept out of the loss",
    )
    agent: AgentConfig = Field(
        default_factory=lambda: AgentConfig(),
        description="task_type: agent: env, env_args, max_turns, max_total_tokens, num_cpus_per_task, timeout_s, "
        "retries",
    )
    dynamic_sampling: bool = Field(
        default=False, description="DAPO's dynamic sampling: drop the prompt groups whose responses all score the "
        "same (no advantage, no learning signal) and generate the stream's next prompts until sample_per_episode "
        "samples are kept or max_sampling_rounds rounds ran; needs prompt groups and stream_data_loader_type: "
        "dynamic (an episode whose rounds ran out trains what it kept)",
    )
    max_sampling_rounds: int = Field(
        default=3, ge=1, description="with dynamic_sampling: the most generation rounds of one episode, the first "
        "included (verl's max_num_gen_batches); each round one episode's worth of prompts",
    )
    partial_rollout_manager_config: PartialRolloutConfig = Field(
        default_factory=lambda: PartialRolloutConfig(),
        description="partial rollouts' max_rollout_round, rollout_ratio, mini_response_per_prompt (ChatLearn HEAD)",
    )
    data_shuffle: bool = Field(
        default=True,
        description="shuffle the prompts in each pass over the dataset, seeded by (seed, pass) "
        "(ChatLearn 1.0.3's key and default; 1.0.2 always read in file order)",
    )
    eval_data_path: str | list[str] | None = Field(
        default=None,
        description="eval prompts (JSONL, JSON, parquet, Arrow, CSV or a save_to_disk directory; a path or a list)"
    )
    eval_post_process_fn: str | None = Field(
        default=None,
        description="'package.module:function(results, context) -> metrics' run on the eval results "
        "(default: the mean score as eval_reward_mean)",
    )
    relay_sample_fn: str | None = Field(
        default=None,
        description="'package.module:function(episode_buffers) -> samples' that builds each relay "
        "episode's training samples; required when max_relay_episode != 0",
    )
    enable_eval_before_training: bool = Field(
        default=False, description="evaluate once before the first episode (ChatLearn 1.0.3)"
    )
    log_args_dict: LogArgsConfig = Field(
        default_factory=lambda: LogArgsConfig(),
        description="experiment trackers (ChatLearn's names): enable_tensorboard/tensorboard_dir, enable_wandb/"
        "wandb_dir/wandb_project/wandb_id/wandb_name/wandb_resume, enable_mlflow/mlflow_tracking_uri/"
        "mlflow_experiment_name",
    )
    # -- fault handling (not in ChatLearn, which stops everything when a model process dies) --
    max_restarts: int = Field(
        default=3, ge=0,
        description="times a run recreates its model processes after one died (a lost Ray worker or node) and "
        "redoes the episode from the last checkpoint, before it fails; 0: fail at once",
    )
    stage_timeout_s: float = Field(
        default=3600.0, gt=0,
        description="seconds one episode stage (generate, score, train, sync, checkpoint, eval) may take before "
        "the run fails naming the stage and the model; a step outside the episodes (model setup, resume, export) "
        "gets this or 600 s, whichever is longer",
    )
    # -- what a run keeps of its samples (not in ChatLearn, which keeps none) --
    trace_samples: str | int = Field(
        default="all",
        description="each episode's samples written to run_dir/traces/episode_NNNNNN.parquet (prompt, response, "
        "rewards by name, advantage, the weight version that generated it, log-probs, ...; `chatlearn trace`): "
        "'all', 'none', or a number N: N of them drawn at random (the same N for the same seed and episode)",
    )
    stall_factor: float = Field(
        default=5.0, ge=0,
        description="an episode running longer than this many times the median of the run's episodes so far (after "
        "three) is said once on the terminal and emitted as the Prefect event chatlearn.run.stalled; 0: never",
    )
    alerts: list[str] = Field(
        default_factory=list,
        description="conditions on each episode's metrics, 'METRIC OP NUMBER [for N episodes]' (e.g. 'reward_mean < "
        "0.1 for 3 episodes'): met N episodes in a row, one is said on the terminal and emitted as the Prefect "
        "event chatlearn.alert, for automations (chatlearn deploy --alert-on registers one that pauses the "
        "deployment)",
    )
    # -- the run directory keeps its run (not in ChatLearn, which overwrites an earlier run's results) --
    resume_with_changes: bool = Field(
        default=False,
        description="continue the run in run_dir although this config differs from the one it was started with "
        "in fields that change results (data, models, algorithm, seed, optimizer); its run_config.json records "
        "the change. Without it such a start is refused, naming the fields (chatlearn train --resume-with-changes)",
    )

    @field_validator("colocation", mode="before")
    @classmethod
    def _colocation_groups(cls, value: Any) -> Any:
        # Accept "a,b" (one group) and [[a, b], "c,d"] as well as ChatLearn's ["a,b", "c,d"].
        if isinstance(value, str):
            value = [value]
        if isinstance(value, (list, tuple)):
            groups = []
            for group in value:
                if isinstance(group, (list, tuple)):
                    group = ",".join(str(name) for name in group)
                if isinstance(group, str):
                    group = ",".join(n.strip() for n in group.split(",") if n.strip())
                    if not group:
                        continue
                groups.append(group)
            return groups
        return value

    @field_validator("stream_data_loader_type", "param_sync_comm_type", mode="after")
    @classmethod
    def _lower_choice(cls, value: str, info: ValidationInfo) -> str:
        # Case-insensitive like ChatLearn's validation, but normalized so later exact comparisons work.
        allowed = STREAM_DATA_LOADER_TYPES if info.field_name == "stream_data_loader_type" else PARAM_SYNC_COMM_TYPES
        return value.lower() if value.lower() in allowed else value

    @field_validator("trace_samples", mode="after")
    @classmethod
    def _trace_samples(cls, value: str | int) -> str | int:
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        if isinstance(value, int) and value < 0 or isinstance(value, str) and value not in ("all", "none"):
            raise ValueError(f"trace_samples is 'all', 'none' or a number of samples >= 0, not {value!r}")
        return value

    @field_validator("alerts", mode="after")
    @classmethod
    def _alerts(cls, value: list[str]) -> list[str]:
        for text in value:
            parse_alert(text)
        return value

    @field_validator("task_type", mode="after")
    @classmethod
    def _task_type(cls, value: str) -> str:
        if value not in TASK_TYPES:
            raise ValueError(f"{value!r} is not one of {list(TASK_TYPES)}")
        return value

    @field_validator("cpu_schedule_strategy", mode="after")
    @classmethod
    def _upper_choice(cls, value: str) -> str:
        return value.upper() if value.upper() in CPU_SCHEDULE_STRATEGIES else value

    @model_validator(mode="after")
    def _resolve(self) -> "RuntimeConfig":
        if self.train_global_batch_size is None:
            self.train_global_batch_size = self.train_micro_batch_size
        self.output_dir = self.run_dir
        return self

    @property
    def run_dir(self) -> str:
        """``output_dir/exp_name``; unchanged when ``output_dir`` already ends with ``exp_name``."""
        out = self.output_dir or "./"
        if not self.exp_name or os.path.basename(os.path.normpath(out)) == self.exp_name:
            return out
        return os.path.join(out, self.exp_name)

    @property
    def colocation_groups(self) -> list[list[str]]:
        """``colocation`` split into lists of model names."""
        return [[n.strip() for n in g.split(",") if n.strip()] for g in self.colocation]

    @property
    def steps_per_episode(self) -> int:
        """Optimizer steps of one episode: epochs x ceil(sample_per_episode / train_global_batch_size)."""
        return self.num_training_epoch * math.ceil(self.sample_per_episode / self.train_global_batch_size)

    @property
    def shuffle_seed(self) -> int | None:
        """The seed of the prompt order when ``data_shuffle`` is on, else None (file order)."""
        return self.seed if self.data_shuffle else None
