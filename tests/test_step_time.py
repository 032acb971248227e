"""Whole-step time (checkpointing/planner/step_time.py): attention counted causally, the FLOPs of
a step against those a real CPU forward and backward runs, the arithmetic of recompute, tiles and
all-to-all, and the report's lines and keys."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from checkpointing.planner.meta_attention import FLASH_CPU as _FLASH_CPU
from checkpointing.planner.meta_attention import attention_flops as _attention_flops
from checkpointing.planner.step_time import step_lines, step_time
from tests.helpers import subprocess_env
from tests.test_report import TINY
from trainer.cli import check
from trainer.preflight.auto_plan import rest_flops
from trainer.preflight.scenario import Evaluator, Scenario
from trainer.preflight.step_report import outcome_step_time
from trainer.task import task_for

# fp32 and no dropout: the CPU runs the flash kernel the meta trace stands in for GPUs.
BASE = [*TINY, "data.seq_len=256", "train.micro_batch_size=2", "checkpointing=none"]


def _outcome(overrides: list[str], world: int = 1):
    cfg, layout = check(overrides, {"WORLD_SIZE": str(world)})
    return Evaluator(400).evaluate(Scenario(cfg, layout, world))


@pytest.mark.parametrize("degree", [1, 2])
def test_attention_is_counted_causally_per_rank(degree) -> None:
    extra = [f"sharding.sequence={degree}"] if degree > 1 else []
    cfg, _ = check(BASE + extra, {"WORLD_SIZE": str(degree)})
    m = cfg.model
    block = _outcome(BASE + extra, world=degree).profile.blocks[0]
    seq, batch, head_dim = cfg.data.seq_len, cfg.train.micro_batch_size, m.dim // m.n_heads
    # Ulysses: each rank attends over the whole sequence with 1/N of the query heads.
    pairs = seq * (seq + 1) // 2
    assert block.attention_flops == 4 * batch * (m.n_heads // degree) * pairs * head_dim
    assert 0 < block.attention_flops < block.forward_flops


def test_a_query_tile_counts_its_causal_prefix() -> None:
    # 64 queries at the end of 256 keys, causal from the bottom right: 256 - 63 .. 256 keys.
    flops = _attention_flops((1, 2, 64, 16), (1, 2, 256, 16), (1, 2, 256, 16), 0.0, True)
    assert flops == 4 * 2 * sum(range(256 - 63, 257)) * 16
    assert _attention_flops((1, 2, 64, 16), (1, 2, 256, 16), (1, 2, 256, 16)) == 4 * 2 * 64 * 256 * 16


# LoRA: the frozen base's linears run no weight gradient; QLoRA's NF4 linears compute on meta
# without a matmul the counter sees (checkpointing/planner/linear_flops.py).
LORA = ["model.lora.rank=4", "model.lora.alpha=8"]


@pytest.mark.parametrize("extra", [[], LORA, [*LORA, "model.lora.quantize=nf4"]],
                         ids=["full", "lora", "qlora"])
def test_step_flops_are_what_a_real_cpu_forward_and_backward_runs(extra) -> None:
    """FlopCounterMode over a real step of the tiny Llama (no recompute): its matmuls forward and
    backward and attention's forward (the CPU flash backward has no formula in torch: left out
    of both sides) against step_time's forward + backward + head, less attention's backward."""
    from trainer.build import build_on_meta, materialize

    outcome = _outcome([*BASE, *extra])
    cfg = outcome.scenario.cfg
    t = step_time(outcome.profile, outcome.plan, 1, rest_flops(cfg, outcome.profile), 400.0,
                  512, 1)
    torch.manual_seed(0)
    model = build_on_meta(cfg.model)
    materialize(model, torch.device("cpu"), seed=0)
    # A frozen embedding leaves the first block's input without a gradient, so its input-side
    # base linears run no backward at all (1/blocks of them; step_time.py counts every block
    # alike): give the input its gradient, as every later block's has (a lookup: no FLOPs).
    model.tok_embeddings.weight.requires_grad_(True)
    task = task_for(cfg.model, cfg.data, cfg.checkpointing)
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.data.seq_len + 1))
    counter = FlopCounterMode(display=False, custom_mapping={_FLASH_CPU: _attention_flops})
    with counter:
        task.loss(model, tokens[:, :-1], tokens[:, 1:]).backward()
    measured = counter.get_total_flops()
    predicted = t.forward_flops + t.backward_flops + t.rest_flops - 2.5 * t.attention_flops
    assert abs(predicted / measured - 1) < 0.01, (predicted, measured)


def test_recompute_tiles_and_all_to_all_add_to_the_step() -> None:
    plain = _outcome(BASE)
    full = _outcome([*BASE[:-1], "checkpointing=full", "checkpointing.tiles=4"])
    rest = rest_flops(plain.scenario.cfg, plain.profile)
    a, b = (step_time(o.profile, o.plan, 3, rest, 100.0, 512, 8) for o in (plain, full))
    assert a.recompute_flops == 0 and a.tile_flops == 0
    assert b.recompute_flops == b.forward_flops  # full: the forward once more
    # tiles re-run their token-wise parts in backward: attention too now (query tiles), so at
    # most the whole forward once more
    assert 0 < b.tile_flops <= b.forward_flops
    assert a.step_s == pytest.approx(a.total_flops / 100e12)
    assert a.tokens_per_rank == 3 * 512
    assert a.tokens_per_s_per_node == pytest.approx(8 * 3 * 512 / a.step_s)
    seq = _outcome([*BASE, "sharding.sequence=2"], world=2)
    s = step_time(seq.profile, seq.plan, 1, rest, 100.0, 256, 2, all_to_all_bytes_per_s=1e9)
    sent = 2 * len(seq.plan) * seq.profile.sent_bytes_per_block  # forward and backward
    assert s.all_to_all_bytes == sent > 0 and s.all_to_all_s == pytest.approx(sent / 1e9)
    assert s.step_s == pytest.approx(s.compute_s + s.all_to_all_s)
    text = "\n".join(step_lines(s))
    assert "all-to-all" in text and "tokens per second" in text and "causal" in text


def test_report_prints_and_writes_the_step_time(tmp_path) -> None:
    result = subprocess.run([sys.executable, "-m", "trainer.report", *BASE, "--world-size", "2",
                             "--tflops", "50", "--out", str(tmp_path)], cwd=tmp_path,
                            env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    data = json.loads((tmp_path / "memory_plan.json").read_text())
    cfg, layout = check(BASE, {"WORLD_SIZE": "2"})
    expected = outcome_step_time(Evaluator(50).evaluate(Scenario(cfg, layout, 2)), 50.0)
    assert data["step_seconds"] == pytest.approx(expected.step_s)
    assert data["tokens_per_s_per_node"] == pytest.approx(expected.tokens_per_s_per_node)
    assert data["step_time"]["tflops"] == 50.0
    assert f"at a nominal 50 TFLOP/s" in result.stdout and "per node of 2" in result.stdout


def test_cpu_offload_copies_add_what_their_block_cannot_hide() -> None:
    """sharding.cpu_offload: each block's copies over the host link cost only what exceeds the
    block's compute (on top of an activation offload's own, which shares the link); the root
    group's are never hidden."""
    from checkpointing.planner.step_time import HostLink

    o = _outcome([*BASE, "checkpointing=full"])
    rest = rest_flops(o.scenario.cfg, o.profile)
    per_flop = 1 / 100e12
    block_s = [m.step_flops() * per_flop for m in o.profile.blocks]
    base = step_time(o.profile, o.plan, 3, rest, 100.0, 512, 8)
    spb = 1e-9
    small = HostLink(tuple(int(0.5 * s / spb) for s in block_s), 1000, spb)  # hidden
    big = HostLink(tuple(int(3 * s / spb) for s in block_s), 1000, spb)  # 2x each block over
    hidden, over = (step_time(o.profile, o.plan, 3, rest, 100.0, 512, 8, host_link=h)
                    for h in (small, big))
    assert hidden.host_link_s == pytest.approx(3 * 1000 * spb)
    assert over.host_link_s == pytest.approx(3 * (sum(b * spb - s for b, s in
                                                      zip(big.block_bytes, block_s)) + 1e-6))
    assert over.step_s == pytest.approx(base.step_s + over.host_link_s)
    assert over.host_link_bytes == 3 * (sum(big.block_bytes) + 1000)
    assert "sharding.cpu_offload copies not hidden" in step_lines(over)[0]
    assert "cpu_offload" not in step_lines(base)[0]
    # an activation offload that already fills the link: there every copy byte costs
    from checkpointing.planner.memory import moved_bytes

    off = _outcome([*BASE, "checkpointing=full", "offload=disk"])
    alone = step_time(off.profile, off.plan, 1, rest, 100.0, 512, 8, offload_s_per_byte=1e-6,
                      offload_min_bytes=0)
    assert alone.offload_s > 0
    both = step_time(off.profile, off.plan, 1, rest, 100.0, 512, 8, offload_s_per_byte=1e-6,
                     offload_min_bytes=0, host_link=small)
    assert both.offload_s == alone.offload_s
    moved = [moved_bytes(m, p, 0) * 1e-6 for m, p in zip(off.profile.blocks, off.plan)]
    assert sum(m > s for m, s in zip(moved, block_s)) >= 1  # some block's offload fills it
    assert both.host_link_s == pytest.approx(1000 * spb + sum(
        max(0.0, m + c * spb - s) - max(0.0, m - s)
        for c, m, s in zip(small.block_bytes, moved, block_s)))
    assert both.host_link_s > hidden.host_link_s / 3  # more than the root's alone


@pytest.mark.parametrize("reshard", [True, False])
def test_the_report_counts_cpu_offload_copies_per_group(reshard) -> None:
    from trainer.preflight.step_report import host_link

    assert host_link(_outcome(BASE, world=2)) is None
    o = _outcome([*BASE, "sharding.cpu_offload=true",
                  f"sharding.reshard_after_forward={str(reshard).lower()}"], world=2)
    link = host_link(o)
    groups = [g.bytes(2, 4, 4) for g in o.groups]  # fp32: stored and computed alike
    gathers = 2 if reshard else 1
    assert link.block_bytes == tuple(gathers * g.params + g.trained for g in groups[1:])
    assert link.root_bytes == groups[0].params + groups[0].trained > 0
    assert len(link.block_bytes) == len(o.plan) and min(link.block_bytes) > 0
    step = outcome_step_time(o, 400.0)
    assert step.host_link_bytes == (sum(link.block_bytes) + link.root_bytes) * len(
        [0] * o.scenario.layout.grad_accum)
    assert step.host_link_s >= link.root_bytes * link.s_per_byte


def test_cpu_offload_host_optimizer_step_counts_once_per_step() -> None:
    """sharding.cpu_offload's AdamW runs on the host over this rank's trained shard, once per
    optimizer step whatever the micro-batches, and the device waits for it."""
    from checkpointing.planner.step_time import HostLink

    o = _outcome([*BASE, "checkpointing=full"])
    rest = rest_flops(o.scenario.cfg, o.profile)
    copies = HostLink((0,) * len(o.plan), 0, 1e-9)
    stepping = HostLink((0,) * len(o.plan), 0, 1e-9, 10_000_000, 5e-9)
    for micro in (1, 4):
        without, with_step = (step_time(o.profile, o.plan, micro, rest, 100.0, 512, 8,
                                        host_link=h) for h in (copies, stepping))
        assert with_step.host_optimizer_s == pytest.approx(0.05)
        assert with_step.step_s == pytest.approx(without.step_s + 0.05)
    assert "host optimizer step 0.1 s (AdamW over 10.0 M elements" in step_lines(with_step)[0]


@pytest.mark.parametrize("lora", [False, True])
def test_the_report_steps_the_host_optimizer_over_the_trained_shard(lora) -> None:
    """The elements the host's AdamW steps: the trained parameters' shard (padded as FSDP2 holds
    it); with LoRA only the adapters."""
    from trainer.preflight.scenario import NOMINAL_HOST_ADAMW_S_PER_ELEMENT
    from trainer.preflight.step_report import host_link

    extra = ["model.lora.rank=8"] if lora else []
    o = _outcome([*BASE, *extra, "sharding.cpu_offload=true"], world=2)
    link = host_link(o)
    trained = sum(g.bytes(2, 4, 4).trained_gathered for g in o.groups) // 2
    every = sum(math.prod(s) for g in o.groups for s in g.shapes)
    assert link.optimizer_numel == trained > 0
    assert (trained < every / 2 / 10) if lora else (trained >= every / 2)
    step = outcome_step_time(o, 400.0)
    assert step.host_optimizer_s == pytest.approx(trained * NOMINAL_HOST_ADAMW_S_PER_ELEMENT)
    assert step.host_optimizer_s > 0
