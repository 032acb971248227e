"""What the ranks sharing a sample send each other per step, and how long it takes at stated
rates: Ulysses' all-to-alls (sharding.sequence) and the ring's neighbour sends (sharding.context),
from the bytes the meta trace counted per block (trainer/preflight/scenario.py). For the report
(tables and memory_plan.json) and the step-time model (trainer/preflight/auto_plan.py).

Rates are NOMINAL_ALL_TO_ALL_BYTES_PER_S (scenario.py): 100 GB/s a rank sends inside a node
(NVLink), 20 GB/s across nodes (one 200 Gb/s port per GPU): round figures, not measurements,
and nothing is assumed overlapped with compute (the ring does overlap its sends with the
attention of the block in hand; the figures are upper bounds).
"""

from __future__ import annotations

from trainer.preflight.scenario import NOMINAL_ALL_TO_ALL_BYTES_PER_S as RATES

MIB, GIB = 2 ** 20, 2 ** 30


def ring_seconds(profile, scenario) -> tuple[float, float, str]:
    """(forward, backward) seconds of one block's ring sends per rank and where its hops run:
    "node" when the N x M ranks sharing a sample sit in one node, else "network" (a ring is as
    fast as its slowest hop)."""
    layout = scenario.layout
    inside = "node" if layout.degree * layout.context <= scenario.gpus_per_node else "network"
    return (profile.ring_sent_bytes_per_block / RATES[inside],
            profile.ring_backward_bytes_per_block / RATES[inside], inside)


def exchange_summary(outcome) -> dict:
    """Bytes per step a rank sends (Ulysses, ring) and their seconds inside a node and across
    nodes; the ring's K/V block (two in flight: double-buffered) and its fp32 gradients."""
    profile, sc = outcome.profile, outcome.scenario
    layout = sc.layout
    blocks, micro = len(profile.blocks), layout.grad_accum
    recomputed = sum(p.recompute != "none" for p in outcome.plan)
    ulysses = profile.sent_bytes_per_block * (2 * blocks * micro + recomputed * micro)
    forward, backward = profile.ring_sent_bytes_per_block, profile.ring_backward_bytes_per_block
    ring = forward * (blocks + recomputed) * micro + backward * blocks * micro
    m = layout.context
    kv_block = forward // (m - 1) if m > 1 else 0
    out = {"sequence": layout.degree, "context": m,
           "ulysses_bytes_per_step": ulysses, "ring_bytes_per_step": ring,
           "ring_kv_block_bytes": kv_block, "ring_kv_in_flight_bytes": 2 * kv_block,
           "ring_grad_block_bytes": (backward - forward) // m if m > 1 else 0,
           "rates_bytes_per_s": dict(RATES),
           "ulysses_hops": "node" if layout.degree <= sc.gpus_per_node else "network",
           "ring_hops": ring_seconds(profile, sc)[2]}
    for where, rate in RATES.items():
        out[f"ulysses_s_per_step_{where}"] = ulysses / rate
        out[f"ring_s_per_step_{where}"] = ring / rate
    return out


def exchange_lines(outcome) -> list[str]:
    """The report's lines on the exchanges (none when one rank holds each sample)."""
    x = exchange_summary(outcome)
    lines = []
    rates = (f"{RATES['node'] / 1e9:g} GB/s in a node, {RATES['network'] / 1e9:g} GB/s across "
             "nodes (stated, not measured; nothing overlapped)")
    if x["sequence"] > 1:
        lines.append(f"Ulysses (sequence {x['sequence']}, its ranks in one "
                     f"{'node' if x['ulysses_hops'] == 'node' else 'network: across nodes'}): "
                     f"{x['ulysses_bytes_per_step'] / GIB:.2f} GiB sent per rank per step = "
                     f"{x['ulysses_s_per_step_node']:.2f} s inside a node, "
                     f"{x['ulysses_s_per_step_network']:.2f} s across nodes at {rates}")
    if x["context"] > 1:
        lines.append(f"ring (context {x['context']}, hops "
                     f"{'inside a node' if x['ring_hops'] == 'node' else 'across nodes'}): "
                     f"K/V block {x['ring_kv_block_bytes'] / MIB:.1f} MiB, two in flight "
                     f"(double-buffered: {x['ring_kv_in_flight_bytes'] / MIB:.1f} MiB), "
                     f"fp32 dK/dV travelling in backward {x['ring_grad_block_bytes'] / MIB:.1f} "
                     f"MiB; {x['ring_bytes_per_step'] / GIB:.2f} GiB sent per rank per step = "
                     f"{x['ring_s_per_step_node']:.2f} s inside a node, "
                     f"{x['ring_s_per_step_network']:.2f} s across nodes")
    return lines
