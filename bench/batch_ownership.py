"""What owning an episode's batches in the driver costs: one model call's data path, the old way against the
new, alternating in one local Ray (issue 24, item 5).

- old: the worker `ray.put`s its batch (owned by the worker, lost with it) and returns the ref; the stage
  fetches that ref;
- new (`Worker.run_batch`): the worker returns ``(done, batch)`` as two return values, the batch owned by the
  caller (the driver); the stage waits on ``done`` only.

Then a second actor reads the batch, as the flow's next call does. Prints the median round trip for a 16 KB,
1 MB and 16 MB batch.

    .venv/bin/python bench/batch_ownership.py
"""

import statistics
import time

import numpy as np
import ray


@ray.remote(num_cpus=0)
class Producer:
    def old(self, n: int) -> ray.ObjectRef:
        return ray.put({"x": np.ones(n, dtype=np.uint8)})

    @ray.method(num_returns=2)
    def new(self, n: int) -> tuple[bool, dict]:
        return True, {"x": np.ones(n, dtype=np.uint8)}


@ray.remote(num_cpus=0)
class Consumer:
    def read(self, batch: dict) -> int:  # a top-level ref arrives resolved
        return int(batch["x"].nbytes)


def old(p: ray.actor.ActorHandle, c: ray.actor.ActorHandle, n: int) -> int:
    inner = ray.get(p.old.remote(n), timeout=60)  # the stage's wait: the batch's ref
    return ray.get(c.read.remote(inner), timeout=60)


def new(p: ray.actor.ActorHandle, c: ray.actor.ActorHandle, n: int) -> int:
    done, batch = p.new.remote(n)
    ray.get(done, timeout=60)  # the stage's wait: done only
    return ray.get(c.read.remote(batch), timeout=60)


def main(rounds: int = 40, warmup: int = 5) -> dict[int, dict[str, float]]:
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    p, c = Producer.remote(), Consumer.remote()
    ray.get([p.__ray_ready__.remote(), c.__ray_ready__.remote()], timeout=120)
    out = {}
    for n in (16 * 1024, 1024 * 1024, 16 * 1024 * 1024):
        times: dict[str, list[float]] = {"old": [], "new": []}
        for i in range(rounds):
            for name, fn in (("old", old), ("new", new)) if i % 2 else (("new", new), ("old", old)):
                t0 = time.perf_counter()
                assert fn(p, c, n) == n
                times[name].append(time.perf_counter() - t0)
        out[n] = {k: 1e3 * statistics.median(v[warmup:]) for k, v in times.items()}
        print(f"{n // 1024:>6} KB: old {out[n]['old']:.2f} ms, new {out[n]['new']:.2f} ms "
              f"(medians of {rounds - warmup} round trips each, alternating)", flush=True)
    ray.shutdown()
    return out


if __name__ == "__main__":
    main()
