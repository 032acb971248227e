"""LoRA (model.lora, trainer/models/lora.py): adapters on a frozen base, sharded with it.

Every checkpointing policy gives the adapters bit-identical gradients (dropout on, 1 and 2
ranks); 2 ranks agree with 1; the loss equals a plain PEFT loop's on the same HF model; a
checkpoint reshards exactly onto another world size."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from checkpointing.meter import SavedBytesMeter
from tests.checkpoint_harness import POLICIES, SMALL, batch
from tests.dist import spawn
from tests.helpers import config, layout_of
from trainer.build import build_model
from trainer.distenv import init_distributed, read_env, shutdown
from trainer.models.llama import lm_loss
from trainer.optim import build_optimizer, build_scheduler, clip_grad_norm

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.dropout=0.1"]
FULL = StateDictOptions(full_state_dict=True)


def _full(tensor):
    tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return tensor.detach().clone()


def _train(overrides: list[str], steps: int, rank: int, make_batch=None):
    """(losses, the last step's gradients by name: None where a parameter has none) of a few
    optimizer steps; the first step moves lora_B off zero, so later steps reach lora_A too."""
    cfg = config(*SMALL, *overrides)
    torch.manual_seed(7 + rank)  # dropout masks: the same sequence for every policy
    built = build_model(cfg, read_env("cpu"), layout=layout_of(cfg), meter=SavedBytesMeter())
    model, optimizer = built.model, build_optimizer(built.model, cfg.optim)
    losses, grads = [], {}
    for step in range(steps):
        tokens = make_batch(step, rank) if make_batch else batch(step, rank)
        loss = lm_loss(model, tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        grads = {n: None if p.grad is None else _full(p.grad) for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
    return torch.stack(losses), grads, [p.recompute for p in built.plan]


def _policies(rank: int, world_size: int):
    return [_train(["model=tiny", *LORA, *policy], 3, rank) for policy in POLICIES]


def _assert_adapters_only_and_bitwise(results) -> None:
    ref_losses, ref_grads, _ = results[0]
    adapters = {n for n, g in ref_grads.items() if g is not None}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    assert len(adapters) < len(ref_grads)  # the base has no gradients
    assert all(ref_grads[n].abs().sum() > 0 for n in adapters)  # lora_A's too, after step 1
    for (losses, grads, plan), policy in zip(results[1:], POLICIES[1:]):
        assert any(r != "none" for r in plan), policy
        assert torch.equal(losses, ref_losses), policy
        assert {n for n, g in grads.items() if g is not None} == adapters, policy
        for name in adapters:
            assert torch.equal(grads[name], ref_grads[name]), (policy, name)


def _one_rank(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    init_distributed(read_env("cpu"), timeout_s=60)  # a world of one, as `python -m trainer`


def test_every_policy_gives_bitwise_identical_adapter_gradients_one_rank(monkeypatch) -> None:
    _one_rank(monkeypatch)
    try:
        results = _policies(0, 1)
    finally:
        shutdown()
    _assert_adapters_only_and_bitwise(results)


@pytest.mark.slow
def test_every_policy_gives_bitwise_identical_adapter_gradients_two_ranks() -> None:
    for results in spawn(_policies, 2):
        _assert_adapters_only_and_bitwise(results)


NO_DROPOUT = ["model=tiny", "model.dropout=0", "model.lora.rank=4", "model.lora.alpha=8"]


def _both_halves(step: int, rank: int) -> torch.Tensor:
    return torch.cat([batch(step, 0), batch(step, 1)])


def _sharded(rank: int, world_size: int):
    losses, grads, _ = _train(NO_DROPOUT, 3, rank)
    dist.all_reduce(losses)  # the mean over ranks: the loss of the whole global batch
    return losses / world_size, grads


def test_two_ranks_agree_with_one(monkeypatch) -> None:
    two = spawn(_sharded, 2)[0]
    _one_rank(monkeypatch)
    try:
        one = _train([*NO_DROPOUT, "train.micro_batch_size=8"], 3, 0, make_batch=_both_halves)
    finally:
        shutdown()
    torch.testing.assert_close(two[0], one[0], rtol=0, atol=1e-6)
    for name, grad in one[1].items():
        if grad is None:
            assert two[1][name] is None, name
        else:
            torch.testing.assert_close(two[1][name], grad, rtol=0, atol=1e-6, msg=name)
