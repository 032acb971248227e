"""Shared by the checkpointing and offload tests: the policies, a seeded batch maker, and the
planner's timings fixed."""

from __future__ import annotations

import contextlib
from typing import Iterator, Mapping
from unittest import mock

import torch

POLICIES = [["checkpointing=none"], ["checkpointing=full"], ["checkpointing=every_k"],
            ["checkpointing=sqrt"], ["checkpointing=selective"],
            # A budget between all-full and all-keep makes the planner mix options.
            ["checkpointing=budget", "checkpointing.budget=0.45"]]
SMALL = ["data.seq_len=64", "train.micro_batch_size=4", "model.dropout=0.1",
         "checkpointing.profile_repeats=1"]


def batch(step: int, rank: int = 0, size: int = 4, seq: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 256, (size, seq + 1), generator=g)


def token_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = batch(step, rank)
    return tokens[:, :-1], tokens[:, 1:]


def train_steps(built, meter, optim_cfg, steps: int, rank: int, make_batch=token_batch,
                loss_fn=None):
    """(losses, the last step's gradients as full tensors, peak offloaded bytes) of a few
    optimizer steps on seeded batches (`make_batch(step, rank)`; next-token loss unless
    `loss_fn` is given), offload hooks on, the offloader closed at the end."""
    from offload.apply import close_offloader, offload_micro_batch
    from trainer.models.llama import lm_loss
    from trainer.optim import build_optimizer

    loss_fn = loss_fn or lm_loss
    optimizer = build_optimizer(built.model, optim_cfg)
    losses, offloaded = [], 0
    try:
        for step in range(steps):
            inputs, targets = make_batch(step, rank)
            with offload_micro_batch(built.offloader):
                with meter.measure():
                    loss = loss_fn(built.model, inputs, targets)
                loss.backward()
            if built.offloader is not None:
                offloaded = max(offloaded, built.offloader.stats.offloaded_bytes)
            grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                     .clone() for n, p in built.model.named_parameters()
                     if p.grad is not None}
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach().clone())
    finally:
        close_offloader(built.offloader)
    return torch.stack(losses), grads, offloaded


def assert_policies_bitwise(results: list, policies: list) -> None:
    """Results (losses, grads, plan, saved bytes) per policy equal the first's (no
    checkpointing) bit for bit, each recomputing somewhere and keeping fewer activations."""
    ref_losses, ref_grads, _, ref_peak = results[0]
    for (losses, grads, plan, peak), overrides in zip(results[1:], policies[1:]):
        assert torch.equal(losses, ref_losses), overrides
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            assert torch.equal(grad, ref_grads[name]), (overrides, name)
        assert any(r != "none" for r in plan), overrides
        assert peak < ref_peak, overrides


# Forward+backward seconds per option (and the forward's own) that fixed_planner_timings gives
# the planner: recompute costs full 0.5 > selective 0.2 > compiler 0.1 per block, so a budget
# plan prefers the compiler's placement, then selective, then full, whatever the machine's load.
PLANNER_SECONDS = {"none": 1.0, "selective": 1.2, "full": 1.5, "compiler": 1.1}
PLANNER_FORWARD_S = 0.5


@contextlib.contextmanager
def fixed_planner_timings(seconds: Mapping[str, float] = PLANNER_SECONDS,
                          forward_s: float = PLANNER_FORWARD_S) -> Iterator[None]:
    """The planner measures each option's bytes as usual, but is given these seconds instead of
    timing the options: a choice made from timings on a loaded machine (the budget planner
    choosing the compiler's placement or not) made what a test checked depend on what else ran.
    The options still run once each (what they keep is measured), untimed."""
    from checkpointing.planner import profile

    measure = profile._measure

    def bytes_measured_seconds_given(candidates, args, kwargs, device, repeats):
        saved, sizes, _, forward = measure(candidates, args, kwargs, device, repeats=0)
        return (saved, sizes, {option: seconds[option] for option in candidates},
                forward_s if forward else 0.0)

    with mock.patch.object(profile, "_measure", bytes_measured_seconds_given):
        yield
