"""`MemoryManager` on CPU: storage is really released, restored exactly, and training is bit-identical with cycles."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from chatlearn.models.memory import PARTS, MemoryManager

MIB = 1024 * 1024
VOCAB = 64


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=True,
    )
    config._attn_implementation = "eager"
    model = LlamaForCausalLM(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def manager(model, optimizer, **flags) -> MemoryManager:
    kwargs = dict(offload_weights=True, offload_optimizer_states=True, free_grad_buffers=True, bucket_size_mb=1)
    kwargs.update(flags)
    return MemoryManager(model, optimizer, **kwargs)


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (2, 12), generator=g)


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


def state_tensors(optimizer) -> list[torch.Tensor]:
    return [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def big_state_tensors(optimizer) -> list[torch.Tensor]:
    return [t for t in state_tensors(optimizer) if t.numel() > 1]


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def trained_one_step(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_of(model, batch(0)).backward()
    optimizer.step()
    loss_of(model, batch(1)).backward()  # leave grads in place
    return optimizer


def train(model, cycles: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.optim.Optimizer]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    mm = manager(model, optimizer)
    losses, evals = [], []
    for step in range(4):
        model.train()
        if cycles:  # at step 0 the optimizer has no state yet: that part must be skipped, not break
            mm.offload()
            mm.onload()
        loss = loss_of(model, batch(step))
        loss.backward()
        if cycles:  # weights and optimizer states out and back while the grads stay in place
            mm.offload(["optimizer", "weights"])
            assert all(p.grad is not None and p.untyped_storage().nbytes() == 0 for p in model.parameters())
            mm.onload()
        optimizer.step()
        losses.append(loss.detach())
        if cycles:
            mm.offload()  # frees the grads: same as zero_grad(set_to_none=True)
            mm.onload()
        else:
            optimizer.zero_grad(set_to_none=True)
        model.eval()
        with torch.no_grad():
            evals.append(model(input_ids=batch(100 + step)).logits)
        if cycles:
            released = mm.offload()
            assert released["weights"] > 0 and released["optimizer"] > 0
            mm.onload()
    return losses, evals, optimizer


def test_training_with_cycles_is_bit_identical():
    plain_model = tiny_llama()
    cycled_model = copy.deepcopy(plain_model)
    plain_losses, plain_evals, plain_opt = train(plain_model, cycles=False)
    cycled_losses, cycled_evals, cycled_opt = train(cycled_model, cycles=True)

    for a, b in zip(plain_losses, cycled_losses):
        assert torch.equal(a, b)
    for a, b in zip(plain_evals, cycled_evals):
        assert torch.equal(a, b)
    plain_params = dict(plain_model.named_parameters())
    cycled_params = dict(cycled_model.named_parameters())
    assert plain_params.keys() == cycled_params.keys()
    for name, p in plain_params.items():
        assert torch.equal(p, cycled_params[name]), name
    assert cycled_model.lm_head.weight is cycled_model.model.embed_tokens.weight
    plain_state, cycled_state = plain_opt.state_dict()["state"], cycled_opt.state_dict()["state"]
    assert plain_state.keys() == cycled_state.keys()
    for idx, s in plain_state.items():
        assert s.keys() == cycled_state[idx].keys()
        for key, v in s.items():
            assert torch.equal(v, cycled_state[idx][key]), (idx, key)


def test_offload_releases_storage_and_onload_restores():
    model = tiny_llama()
    optimizer = trained_one_step(model)
    params = list(model.parameters())
    states = big_state_tensors(optimizer)
    assert states and all(p.grad is not None for p in params)
    expected = {
        "grads": sum(nbytes(p.grad) for p in params),
        "optimizer": sum(nbytes(t) for t in states),
        "weights": sum(nbytes(p) for p in params),
    }
    param_snap = [(p.detach().clone(), p.shape) for p in params]
    state_snap = [(t.clone(), t.shape) for t in states]
    steps = [s["step"] for s in optimizer.state.values()]
    step_snap = [t.clone() for t in steps]

    mm = manager(model, optimizer)
    released = mm.offload()
    assert released == expected
    assert all(not mm.resident(part) for part in PARTS)
    assert all(p.untyped_storage().nbytes() == 0 for p in params)
    assert all(t.untyped_storage().nbytes() == 0 for t in states)
    assert all(p.grad is None for p in params)
    for t, snap in zip(steps, step_snap):  # 0-dim `step` tensors stay put
        assert torch.equal(t, snap)
    assert mm.offload() == dict.fromkeys(PARTS, 0)  # twice: a no-op

    mm.onload()
    assert all(mm.resident(part) for part in PARTS)
    assert list(model.parameters()) == params  # the same Parameter objects
    for p, (value, shape) in zip(params, param_snap):
        assert p.shape == shape and p.untyped_storage().nbytes() == nbytes(value)
        assert torch.equal(p, value)
    assert [id(t) for t in big_state_tensors(optimizer)] == [id(t) for t in states]  # the same state tensors
    for t, (value, shape) in zip(states, state_snap):
        assert t.shape == shape and torch.equal(t, value)
    assert all(p.grad is None for p in params)
    mm.onload()  # already resident: a no-op
    assert all(torch.equal(p, value) for p, (value, _) in zip(params, param_snap))

    # the optimizer keeps working on the restored tensors
    loss_of(model, batch(2)).backward()
    optimizer.step()


def test_parts_can_be_chosen_and_unknown_parts_are_refused():
    model = tiny_llama()
    optimizer = trained_one_step(model)
    mm = manager(model, optimizer)
    released = mm.offload(["weights"])
    assert set(released) == {"weights"} and released["weights"] > 0
    assert not mm.resident("weights") and mm.resident("optimizer") and mm.resident("grads")
    assert all(t.untyped_storage().nbytes() > 0 for t in big_state_tensors(optimizer))
    mm.onload(["optimizer"])  # not offloaded: nothing to do
    assert not mm.resident("weights")
    mm.onload(["weights"])
    assert mm.resident("weights")
    with pytest.raises(ValueError):
        mm.offload(["activations"])
    with pytest.raises(ValueError):
        mm.resident("activations")
    with pytest.raises(ValueError):
        manager(model, optimizer, bucket_size_mb=0)


def test_flag_off_keeps_part_resident():
    model = tiny_llama()
    optimizer = trained_one_step(model)
    params = list(model.parameters())
    mm = manager(model, optimizer, offload_weights=False)
    released = mm.offload()
    assert released["weights"] == 0 and released["optimizer"] > 0 and released["grads"] > 0
    assert mm.resident("weights")
    assert all(p.untyped_storage().nbytes() == nbytes(p) > 0 for p in params)
    assert all(t.untyped_storage().nbytes() == 0 for t in big_state_tensors(optimizer))
    mm.onload()

    loss_of(model, batch(3)).backward()
    mm = manager(model, optimizer, free_grad_buffers=False, offload_optimizer_states=False)
    grads = [p.grad.clone() for p in params]
    released = mm.offload()
    assert released["grads"] == 0 and released["optimizer"] == 0 and released["weights"] > 0
    assert mm.resident("grads") and mm.resident("optimizer")
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))
    assert all(t.untyped_storage().nbytes() > 0 for t in big_state_tensors(optimizer))
    mm.onload()


def test_no_optimizer_and_no_state_yet():
    model = tiny_llama()
    mm = manager(model, None)
    released = mm.offload()
    assert released["optimizer"] == 0 and released["grads"] == 0 and released["weights"] > 0
    mm.onload()

    optimizer = torch.optim.AdamW(model.parameters())
    mm = manager(model, optimizer)
    assert mm.offload(["optimizer"]) == {"optimizer": 0}
    assert mm.resident("optimizer")  # nothing was there to release


def test_bucket_size_bounds_staging_buffers():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(6)])  # 256 KiB weights, 1.5 MiB total
    assert sum(nbytes(p) for p in model.parameters()) > MIB
    assert all(nbytes(p) <= MIB for p in model.parameters())
    snap = [p.detach().clone() for p in model.parameters()]
    mm = manager(model, None, bucket_size_mb=1)
    mm.offload()
    assert 1 < mm.num_buckets_last_offload
    assert 0 < mm.max_bucket_bytes <= MIB
    mm.onload()
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), snap))

    # a parameter larger than a bucket gets a bucket of its own size; dtypes are staged in separate buckets
    big = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(8, 8).to(torch.bfloat16))
    snap = [p.detach().clone() for p in big.parameters()]
    mm = manager(big, None, bucket_size_mb=1)
    mm.offload()
    assert mm.max_bucket_bytes == 4 * MIB
    assert mm.num_buckets_last_offload == 3  # the big weight, its bias, the bf16 layer
    mm.onload()
    for p, s in zip(big.parameters(), snap):
        assert p.dtype == s.dtype and torch.equal(p, s)


def test_tied_weights_stay_one_parameter():
    model = tiny_llama()
    optimizer = trained_one_step(model)
    tied = model.model.embed_tokens.weight
    assert model.lm_head.weight is tied
    value = tied.detach().clone()
    unique_bytes = sum(nbytes(p) for p in model.parameters())
    all_names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert len(all_names) == len(list(model.parameters())) + 1  # lm_head.weight is the one duplicate
    mm = manager(model, optimizer)
    released = mm.offload()
    assert released["weights"] == unique_bytes  # the tied weight staged and counted once
    assert model.lm_head.weight is tied and model.model.embed_tokens.weight is tied
    assert tied.untyped_storage().nbytes() == 0
    mm.onload()
    assert model.lm_head.weight is tied and model.model.embed_tokens.weight is tied
    assert torch.equal(tied, value) and torch.equal(model.lm_head.weight, value)
    assert tied in optimizer.state


def test_channels_last_layout_is_restored():
    conv = torch.nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    w = conv.weight
    assert not w.is_contiguous() and w.is_contiguous(memory_format=torch.channels_last)
    value, stride = w.detach().clone(), w.stride()
    mm = manager(conv, None)
    mm.offload()
    assert w.untyped_storage().nbytes() == 0
    mm.onload()
    assert w.stride() == stride and torch.equal(w, value)
