"""Memory that stays flat (issue 45 item 11): a model process bounds oneDNN's per-shape kernel caches, so bf16
matmuls of ever new shapes (packed micro-batches, continuous batching) stop adding memory once the caches are
full. Each case runs in a fresh interpreter: the capacities are read when a process builds its first kernel."""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from chatlearn.models.precision import KERNEL_CACHE_CAPACITY, bound_kernel_caches

# a bf16 linear's forward and backward (three oneDNN kernels) over 300 row counts, as packed micro-batches of
# 100..399 tokens would run it; RSS growth over the last 100 (the first 200 fill a bounded cache), read after
# malloc_trim: freed heap that glibc keeps would otherwise count as growth (it made a bound process look 20 MB
# bigger here)
GROWTH = """
import ctypes, json, sys
import psutil, torch
if sys.argv[1] == "bound":
    from chatlearn.models.torch_module import TorchModule
    from chatlearn.utils.arguments import ModelConfig, RuntimeConfig
    TorchModule("m").bind(ModelConfig(num_cpu=1, cpu_per_process=1), RuntimeConfig(), 0, seed=0)
torch.set_num_threads(1)
w = torch.randn(512, 256, requires_grad=True)
x0 = torch.randn(400, 256)
def step(rows):
    x = x0[:rows].clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.nn.functional.linear(x, w)
    y.float().sum().backward()
for rows in range(100, 300):
    step(rows)
def rss():
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return psutil.Process().memory_info().rss
before = rss()
for rows in range(300, 400):
    step(rows)
print(json.dumps((rss() - before) / 2**20))
"""


def _growth_mb(mode: str) -> float:
    # a module bound earlier in this test process set the capacities in its environment: the control must not inherit
    env = {k: v for k, v in os.environ.items() if k not in bound_kernel_caches(environ={})}
    out = subprocess.run([sys.executable, "-c", GROWTH, mode], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_bound_model_process_stops_growing_on_new_bf16_shapes():
    with ThreadPoolExecutor(2) as pool:
        unbounded, bound = pool.map(_growth_mb, ["plain", "bound"])
    # the control: without the bound, the 300 new kernels stay (13 MB on an AVX-512 CPU without AMX)
    if unbounded < 5:
        pytest.skip(f"bf16 matmuls do not build oneDNN kernels per shape on this CPU (+{unbounded:.1f} MB unbounded)")
    assert bound < unbounded / 4, \
        f"a bound process grew {bound:.1f} MB over 100 new shapes (unbounded: {unbounded:.1f} MB)"


def test_capacities_the_user_set_are_kept():
    env = {"LRU_CACHE_CAPACITY": "4096"}
    assert bound_kernel_caches(environ=env) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(KERNEL_CACHE_CAPACITY),
                                                "LRU_CACHE_CAPACITY": "4096"}
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(KERNEL_CACHE_CAPACITY)
