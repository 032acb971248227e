"""Activation checkpointing: every policy changes memory and compute, never the maths."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from checkpointing.plan import recompute_pattern
from checkpointing.meter import SavedBytesMeter
from trainer.distenv import init_distributed, read_env, shutdown
from tests.checkpoint_harness import POLICIES, SMALL, batch
from tests.dist import spawn
from tests.helpers import config, layout_of
from trainer.build import build_model
from trainer.config import DEFAULT_SAVE_OPS
from trainer.models.llama import lm_loss
from trainer.optim import build_optimizer


def _train_steps(overrides: list[str], steps: int = 3, rank: int = 0):
    """(losses, final grads as full tensors, plan, meter peak) of a few optimizer steps."""
    cfg = config(*SMALL, *overrides)
    denv = read_env("cpu")
    meter = SavedBytesMeter()
    torch.manual_seed(7 + rank)  # dropout masks: the same sequence for every policy
    built = build_model(cfg, denv, layout=layout_of(cfg), meter=meter)
    model = built.model
    optimizer = build_optimizer(model, cfg.optim)
    losses = []
    for step in range(steps):
        tokens = batch(step, rank)
        with meter.measure():
            loss = lm_loss(model, tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                 for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
    return torch.stack(losses), grads, [p.recompute for p in built.plan], meter.peak


def _run_policies(rank: int, world_size: int, model: str = "tiny"):
    return [_train_steps([f"model={model}", *overrides], rank=rank) for overrides in POLICIES]


def _assert_bitwise_equal(results) -> None:
    ref_losses, ref_grads, _, _ = results[0]
    for (losses, grads, plan, _), overrides in zip(results[1:], POLICIES[1:]):
        assert torch.equal(losses, ref_losses), (overrides, losses, ref_losses)
        for name, grad in grads.items():
            assert torch.equal(grad, ref_grads[name]), (overrides, name)
        assert any(r != "none" for r in plan), overrides  # the policy did recompute something


# Every built-in language model (qwen3_tiny: Llama's blocks with q/k norms, wider heads, tied).
MODELS = ["tiny", "qwen3_tiny"]


@pytest.mark.parametrize("model", MODELS)
def test_every_policy_gives_bitwise_identical_gradients_one_rank(monkeypatch, model) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    init_distributed(read_env("cpu"), timeout_s=60)  # a world of one, as `python -m trainer`
    try:
        results = _run_policies(0, 1, model)
    finally:
        shutdown()
    _assert_bitwise_equal(results)
    plans = {tuple(o): r[2] for o, r in zip(POLICIES, results)}
    assert plans[("checkpointing=every_k",)] == ["full", "none", "full", "none"]
    assert plans[("checkpointing=sqrt",)] == ["full", "none", "full", "none"]
    budget_plan = plans[("checkpointing=budget", "checkpointing.budget=0.45")]
    assert len(set(budget_plan)) > 1, budget_plan  # a genuine mix, not one option everywhere


@pytest.mark.parametrize("model", MODELS)
def test_every_policy_gives_bitwise_identical_gradients_two_ranks_fsdp(model) -> None:
    per_rank = spawn(_run_policies, 2, model)
    for results in per_rank:
        _assert_bitwise_equal(results)


def test_patterns() -> None:
    assert recompute_pattern("every_k", 5, every=3) == ["full", "none", "none", "full", "none"]
    # sqrt: ~sqrt(N) blocks keep their activations, the rest recompute.
    pattern = recompute_pattern("sqrt", 80)
    assert pattern.count("none") == 8 and pattern.count("full") == 72
    assert set(DEFAULT_SAVE_OPS) >= {"mm", "addmm", "bmm"}


def _block_and_inputs(recompute: str):
    """A materialised tiny-Llama block wrapped for `recompute`, and inputs at real shapes."""
    from checkpointing.wrap import checkpoint_block, resolve_ops
    from trainer.build import build_on_meta, materialize
    from trainer.models.llama import rope_cos_sin

    model = build_on_meta(config("model.dropout=0.0").model)
    materialize(model, torch.device("cpu"), seed=0)
    block = model.layers[0]
    meter = SavedBytesMeter()
    checkpoint_block(block, recompute, resolve_ops(DEFAULT_SAVE_OPS), meter)
    hidden = torch.randn(4, 64, 128, requires_grad=True)
    return block, (hidden, rope_cos_sin(32, 64, 10000.0, torch.device("cpu"))), meter


def _flops(recompute: str) -> tuple[int, int, dict]:
    """(forward+backward FLOPs, forward-only FLOPs, matmul FLOPs by op) of one block."""
    block, args, _ = _block_and_inputs(recompute)
    with FlopCounterMode(display=False) as forward_only:
        block(*args)
    with FlopCounterMode(display=False) as counter:
        block(*args).square().sum().backward()
    by_op = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    return counter.get_total_flops(), forward_only.get_total_flops(), by_op


def test_full_recomputes_exactly_one_forward_and_selective_no_matmul() -> None:
    none_total, forward, none_ops = _flops("none")
    full_total, _, _ = _flops("full")
    selective_total, _, selective_ops = _flops("selective")
    assert forward > 0 and none_total > 2 * forward
    # One more forward of the block, minus its last matmul: non-reentrant checkpointing stops
    # recomputing once every tensor backward needs exists, and the FFN's down-projection output
    # (4 x 64 tokens, 384 -> 128) is not one of them.
    last_matmul = 2 * (4 * 64) * 384 * 128
    assert full_total == none_total + forward - last_matmul
    # Matmul outputs are kept, so not a single matmul FLOP is spent again.
    assert selective_total == none_total
    matmuls = {op: n for op, n in none_ops.items() if "mm" in op}
    assert matmuls and all(selective_ops[op] == n for op, n in matmuls.items())


def test_saved_bytes_order_and_full_matches_analytic() -> None:
    measured = {}
    for recompute in ("none", "selective", "full"):
        block, args, meter = _block_and_inputs(recompute)
        with meter.measure():
            out = block(*args)
        out.sum().backward()
        measured[recompute] = meter.bytes
    assert measured["none"] > measured["selective"] > measured["full"]
    # Analytic: a fully recomputed block keeps only its inputs (hidden, rotary cos and sin).
    hidden, (cos, sin) = args
    analytic = sum(t.numel() * t.element_size() for t in (hidden, cos, sin))
    assert abs(measured["full"] - analytic) <= 0.1 * analytic


def _all_gather_bytes(rank: int, world_size: int) -> dict[str, int]:
    counted: dict[str, int] = {}
    # FSDP2 calls all_gather_single (newer torch) or all_gather_into_tensor (older).
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    originals = {name: getattr(dist, name) for name in names}

    def counting(original):
        def wrapper(output, *args, **kwargs):
            counted[current] = counted.get(current, 0) + output.numel() * output.element_size()
            return original(output, *args, **kwargs)
        return wrapper

    for name in names:
        setattr(dist, name, counting(originals[name]))
    try:
        for current in ("none", "full", "selective"):
            _train_steps([f"checkpointing={current}", "model.dropout=0.0"], steps=1, rank=rank)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return counted


def test_recompute_does_not_all_gather_again_two_ranks() -> None:
    for counted in spawn(_all_gather_bytes, 2):
        assert counted["none"] > 0
        assert counted["full"] == counted["none"] and counted["selective"] == counted["none"]


class _Layer(torch.nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up, self.down = torch.nn.Linear(width, hidden), torch.nn.Linear(hidden, width)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


class _Uneven(torch.nn.Module):
    """Blocks of one class but different sizes: each needs its own profile."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Layer(32, h) for h in (64, 256, 64, 512, 128))
        self.head = torch.nn.Linear(32, 5)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).mean()


def test_budget_plan_for_heterogeneous_blocks_is_exact_and_bitwise() -> None:
    from checkpointing.blocks import find_blocks
    from checkpointing.planner.policies import choose_plan, predicted_saved_bytes, resolve_budget
    from checkpointing.planner.profile import profile_blocks, trace_on_meta
    from checkpointing.wrap import apply_checkpointing, resolve_ops
    from trainer.build import materialize

    def build() -> tuple[torch.nn.Module, list]:
        with torch.device("meta"):
            model = _Uneven()
        return model, [m for _, m in find_blocks(model)]

    model, blocks = build()
    names = [f"blocks.{i}" for i in range(5)]
    x_meta = torch.empty(8, 16, 32, device="meta")
    trace = trace_on_meta(model, blocks, lambda m: m(x_meta))
    profiles = profile_blocks(blocks, trace, torch.device("cpu"), resolve_ops(["addmm", "mm"]), 1)
    keep = [p.saved_bytes["none"] for p in profiles]
    assert len(set(keep)) == 4  # four distinct block sizes, each measured
    budget = resolve_budget(0.5, profiles, trace.rest_saved_bytes)
    plan = choose_plan("budget", names, shard=False, profiles=profiles,
                       rest_bytes=trace.rest_saved_bytes, budget=budget)
    assert predicted_saved_bytes(plan, profiles, trace.rest_saved_bytes) <= budget.bytes
    assert {p.recompute for p in plan} != {"none"}

    x = torch.randn(8, 16, 32)
    results = []
    for use_plan in (False, True):
        model, blocks = build()
        if use_plan:
            apply_checkpointing(blocks, plan, ["addmm", "mm"], meter=None)
        materialize(model, torch.device("cpu"), seed=1)
        torch.manual_seed(3)
        meter = SavedBytesMeter()
        with meter.measure():
            loss = model(x)
        loss.backward()
        results.append(({n: p.grad for n, p in model.named_parameters()}, meter.bytes))
    (ref, ref_bytes), (got, got_bytes) = results
    assert all(torch.equal(ref[n], got[n]) for n in ref)
    assert got_bytes <= budget.bytes < ref_bytes
