"""Scheduled-but-fake GPUs: declare GPUs to Ray on a machine without any, and keep the math on the CPU.

``CHATLEARN_FAKE_GPUS=N`` makes a local Ray declare N GPUs, so GPU placement (placement groups, shares,
device ids) runs for real while every module computes on the CPU. It is for testing layouts; a real GPU
machine never needs it.
"""

import os


def fake_gpus() -> int:
    """The number of fake GPUs declared with ``CHATLEARN_FAKE_GPUS`` (0: off)."""
    value = os.environ.get("CHATLEARN_FAKE_GPUS", "").strip()
    if not value:
        return 0
    try:
        count = int(value)
    except ValueError:
        raise ValueError(f"CHATLEARN_FAKE_GPUS: expected a number of GPUs, got {value!r}") from None
    if count < 0:
        raise ValueError(f"CHATLEARN_FAKE_GPUS: must be >= 0, got {count}")
    return count
