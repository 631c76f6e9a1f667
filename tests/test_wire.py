"""Sample lists cross processes as NumPy arrays and come back as the same tensors."""

import pickle

import pytest
import torch

from chatlearn.utils.wire import packed


def test_a_packed_structure_unpickles_to_equal_writable_tensors():
    samples = [{"ids": torch.arange(5), "lp": torch.randn(5), "half": torch.randn(3).to(torch.bfloat16),
                "mask": torch.tensor([True, False]), "grad": torch.ones(2, requires_grad=True),
                "text": "x", "n": 3, "pair": (torch.zeros(2), "y"), "none": None} for _ in range(4)]
    back = pickle.loads(pickle.dumps(packed(samples), protocol=5))
    assert isinstance(back, list) and len(back) == 4
    for a, b in zip(samples, back, strict=True):
        assert set(a) == set(b) and b["text"] == "x" and b["n"] == 3 and b["none"] is None
        for k in ("ids", "lp", "half", "mask"):
            assert b[k].dtype == a[k].dtype and torch.equal(b[k], a[k]), k
        assert torch.equal(b["grad"], a["grad"].detach()) and not b["grad"].requires_grad
        assert isinstance(b["pair"], tuple) and torch.equal(b["pair"][0], a["pair"][0]) and b["pair"][1] == "y"
        b["lp"].add_(1)  # writable, and its own memory
        assert not torch.equal(b["lp"], a["lp"])


def test_a_packed_list_is_smaller_than_pickled_tensors():
    samples = [{k: torch.randn(14) for k in "abcdefgh"} for _ in range(64)]
    assert len(pickle.dumps(packed(samples), protocol=5)) < len(pickle.dumps(samples, protocol=5)) / 2


@pytest.mark.integration
def test_packed_samples_through_the_object_store(ray_session):
    import ray

    samples = [{"ids": torch.arange(3) + i} for i in range(3)]
    back = ray.get(ray.put(packed(samples)))
    assert [s["ids"].tolist() for s in back] == [[0, 1, 2], [1, 2, 3], [2, 3, 4]]
    back[0]["ids"][0] = 9  # a copy, not Ray's read-only buffer
