"""The ring in the memory model and the report (issue 45): the meta trace runs the ring's own code
(sharding/ring.py's MetaRingExchange), so one rank's activations shrink with sharding.context, its
sends are the K/V blocks (forward) and the K/V blocks again with their fp32 gradients (backward),
the step time carries them, and the report prints the buffers and the exchange per step inside a
node and across nodes. Tiny models on meta."""

from __future__ import annotations

import pytest

from tests.test_sequence_plan import TINY, _scenario
from trainer.preflight.auto_plan import auto_table, decide, flop_timing, sequence_shapes
from trainer.preflight.exchange import exchange_lines, exchange_summary
from trainer.preflight.longest import step_of
from trainer.preflight.splits import sample_splits
from trainer.preflight.step_report import outcome_step_time
from trainer.preflight.scenario import NOMINAL_ALL_TO_ALL_BYTES_PER_S, Evaluator, Scenario

# tiny: dim 128, 4 heads of 32, 2 KV heads, fp32, 4 blocks; data.seq_len=1024
KV_HEADS, HEAD_DIM, SEQ, BLOCKS = 2, 32, 1024, 4


def test_the_ring_divides_activations_and_sends_its_kv_blocks() -> None:
    evaluator = Evaluator(400)
    alone = evaluator.evaluate(_scenario(TINY, world=4))
    ring = evaluator.evaluate(_scenario(TINY + ["sharding.context=4"], world=4))
    both = evaluator.evaluate(_scenario(TINY + ["sharding.context=2", "sharding.sequence=2"],
                                        world=4))
    assert ring.estimate.activation_peak < 0.4 * alone.estimate.activation_peak
    assert both.estimate.activation_peak < 0.4 * alone.estimate.activation_peak
    # One K/V block: this rank's KV heads (all: no Ulysses) x T/M tokens x head_dim, K and V.
    kv_block = 2 * KV_HEADS * (SEQ // 4) * HEAD_DIM * 4
    assert ring.profile.ring_sent_bytes_per_block == 3 * kv_block  # M - 1 hops
    # Backward: the K/V blocks again (M - 1 hops) and their fp32 gradients (M hops).
    assert ring.profile.ring_backward_bytes_per_block == 3 * kv_block + 4 * kv_block
    assert ring.profile.sent_bytes_per_block == 0 < both.profile.sent_bytes_per_block
    # Ulysses (2) inside the ring (2): a KV head per rank, half the tokens per ring place.
    assert both.profile.ring_sent_bytes_per_block == 2 * 1 * (SEQ // 2) * HEAD_DIM * 4


def test_the_step_time_and_the_report_carry_the_rings_sends() -> None:
    evaluator = Evaluator(400)
    scenario = _scenario(TINY + ["sharding.context=4"], world=4)
    outcome = evaluator.evaluate(scenario)
    timing = flop_timing(evaluator)(scenario.cfg, scenario, evaluator)[0]
    block, rate = outcome.profile.blocks[0], NOMINAL_ALL_TO_ALL_BYTES_PER_S["node"]
    sends = (outcome.profile.ring_sent_bytes_per_block
             + outcome.profile.ring_backward_bytes_per_block) / rate
    assert timing.block_compute[0] == pytest.approx(
        (3 * block.forward_flops + 0.5 * block.attention_flops) * evaluator.seconds_per_flop
        + sends, rel=1e-12)
    # The ring's attention counted causally: its own keys' step a causal square, the other
    # M - 1 steps half a square each (the balanced layout), one query head per kernel call.
    local = SEQ // 4
    pairs = local * (local + 1) // 2 + 3 * local * local // 2
    assert block.attention_flops == 4 * 4 * pairs * HEAD_DIM  # 4 heads, 2 matmuls x 2 FLOPs
    x = exchange_summary(outcome)
    kv_block = 2 * KV_HEADS * (SEQ // 4) * HEAD_DIM * 4
    assert x["ring_kv_block_bytes"] == kv_block and x["ring_kv_in_flight_bytes"] == 2 * kv_block
    # full recomputes every block: the forward's sends twice, the backward's once
    per_block = 2 * 3 * kv_block + 7 * kv_block
    assert x["ring_bytes_per_step"] == BLOCKS * per_block and x["ring_hops"] == "node"
    assert x["ring_s_per_step_network"] == pytest.approx(
        BLOCKS * per_block / NOMINAL_ALL_TO_ALL_BYTES_PER_S["network"])
    [line] = exchange_lines(outcome)
    assert line.startswith("ring (context 4, hops inside a node): K/V block 0.1 MiB")
    # Across 2 nodes of 2 GPUs the ring's hops leave the node.
    spread = evaluator.evaluate(Scenario(scenario.cfg, scenario.layout, 2))
    assert exchange_summary(spread)["ring_hops"] == "network"
    # A rank's tokens per step are its 1/(sequence x context) of the sample (issue 44's
    # tokens/s), not the Ulysses share alone.
    both = evaluator.evaluate(_scenario(TINY + ["sharding.context=2", "sharding.sequence=2"],
                                        world=4))
    for out in (outcome, both):
        assert outcome_step_time(out, 400.0).tokens_per_rank == SEQ // 4


def test_auto_and_longest_keep_the_rings_chunks() -> None:
    scenario = _scenario(TINY + ["sharding.sequence=auto", "sharding.context=2"], world=8)
    # a ring of 2 set: N x 2 divides the world, 2 x N x 2 the length
    assert sequence_shapes(scenario.cfg, scenario.layout) == [(1, 2, 1), (2, 2, 1), (4, 2, 1)]
    fixed = _scenario(TINY + ["sharding.sequence=2", "sharding.context=4"], world=8)
    assert step_of(fixed, 1000) == 2000  # lcm(1000, sequence 2 x 2 x context 4 = 16)


def test_auto_splits_ulysses_inside_a_node_and_the_heads_and_rings_the_rest() -> None:
    # tiny has 4 heads; 16 ranks in 4 nodes of 4 (Scenario's gpus_per_node)
    scenario = _scenario(TINY + ["sharding.sequence=auto"], world=16)
    assert sample_splits(scenario.cfg, scenario.layout, 4) == [
        (1, 1), (2, 1), (4, 1), (4, 2), (4, 4)]
    assert sample_splits(scenario.cfg, scenario.layout, 2) == [
        (1, 1), (2, 1), (2, 2), (2, 4), (2, 8)]  # Ulysses kept in nodes of 2
    # A model the ring cannot serve (attention dropout) stops at what Ulysses reaches.
    dropout = _scenario(TINY[1:] + ["model.dropout=0.1", "sharding.sequence=auto"], world=16)
    assert sample_splits(dropout.cfg, dropout.layout, 4) == [(1, 1), (2, 1), (4, 1)]


def test_auto_chooses_the_ring_when_ulysses_alone_does_not_fit() -> None:
    evaluator = Evaluator(400)
    tiny = [t for t in TINY if not t.startswith("data.seq_len")] + ["data.seq_len=4096"]
    alone = evaluator.evaluate(_scenario(tiny + ["sharding.sequence=2"], world=8))
    ring = evaluator.evaluate(_scenario(tiny + ["sharding.sequence=2", "sharding.context=2"],
                                        world=8))
    capacity = (alone.estimate.peak.total + ring.estimate.peak.total) // 2
    scenario = _scenario(tiny + ["sharding.sequence=auto"], world=8)
    nodes_of_2 = Scenario(scenario.cfg, scenario.layout, 2)
    decision = decide(scenario.cfg, nodes_of_2, evaluator, capacity, flop_timing(evaluator))
    assert (decision.sequence, decision.context) == (2, 2)
    refused = [(c.sequence, c.context) for c in decision.candidates if c.plan == "refused"]
    assert refused == [(1, 1), (2, 1)]
    assert " ctx " in auto_table(decision).splitlines()[0]
