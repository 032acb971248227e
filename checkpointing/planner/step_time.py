"""Whole-step time from FLOPs: what a plan costs per optimizer step, and tokens per second.

Pure arithmetic over the meta profile (checkpointing/planner/metatrace.py), per micro-batch and
summed over the step's micro-batches:

  forward      every block's forward FLOPs; attention counted causally (each query attends to
               the keys before it: half the T x T matmuls, meta_attention.attention_flops)
  backward     2 x the forward of the matmuls, 2.5 x the forward of attention (the flash
               backward's five T x T matmuls against the forward's two), 1 x the forward of a
               frozen linear (a LoRA base: no weight gradient; linear_flops.py). A frozen
               embedding leaves the first block's input without gradient, so there its
               input-side frozen linears run no backward at all: not counted (1/blocks)
  recompute    the forward FLOPs each block's recompute option runs again in backward
  tiles        the tiled modules' forward once more in backward (checkpointing/tiles.py)
  rest         embedding, output layer and loss, forward and backward (the caller's count)

at a nominal FLOP rate (not measured: the report's --tflops), plus Ulysses' all-to-alls (the bytes
a rank sends per block forward, measured on meta, at a stated bandwidth: twice per block, once
more when it recomputes; not overlapped) and the offload transfers a block's compute cannot hide.
With sharding.cpu_offload (FSDP2's CPUOffloadPolicy) each block's parameter shard also comes in
from host memory before each of its all-gathers and its gradient shard goes out after each
reduce-scatter, on the same link as the activation offload and hidden only behind the same
block's compute; the root group's (embedding, head) copies are not hidden; and the optimizer
steps on the host, over this rank's trained shard, at a nominal host rate, once per step and not
overlapped (the device waits for the parameters it updates). Left out: an NF4 base's
dequantization.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class StepTime:
    """One optimizer step of one rank (all micro-batches)."""

    forward_flops: float
    backward_flops: float
    recompute_flops: float
    tile_flops: float
    rest_flops: float
    attention_flops: float  # of forward_flops: causal attention's two matmuls
    tflops: float  # the nominal rate the compute seconds assume
    compute_s: float
    all_to_all_bytes: float  # this rank sends
    all_to_all_bytes_per_s: Optional[float]
    all_to_all_s: float
    offload_s: float  # transfers not hidden behind their block's compute
    step_s: float
    tokens_per_rank: int  # per step: this rank's share of the tokens
    gpus_per_node: int
    host_link_bytes: float = 0.0  # sharding.cpu_offload: parameters in, gradients out
    host_link_s: float = 0.0  # of those copies, what compute does not hide (in step_s)
    host_optimizer_numel: int = 0  # sharding.cpu_offload: elements the host's optimizer steps
    host_optimizer_s: float = 0.0  # that step, once per optimizer step (in step_s)

    @property
    def total_flops(self) -> float:
        return (self.forward_flops + self.backward_flops + self.recompute_flops
                + self.tile_flops + self.rest_flops)

    @property
    def tokens_per_s_per_rank(self) -> float:
        return self.tokens_per_rank / self.step_s if self.step_s else 0.0

    @property
    def tokens_per_s_per_node(self) -> float:
        return self.tokens_per_s_per_rank * self.gpus_per_node

    def as_dict(self) -> dict:
        return {**asdict(self), "total_flops": self.total_flops,
                "tokens_per_s_per_rank": self.tokens_per_s_per_rank,
                "tokens_per_s_per_node": self.tokens_per_s_per_node}


@dataclass(frozen=True)
class HostLink:
    """sharding.cpu_offload's copies per micro-batch on one rank, and the link's rate."""

    block_bytes: tuple[int, ...]  # per block: parameter shard in per all-gather, gradient out
    root_bytes: int  # the root group's (embedding, head): gathered once, not hidden
    s_per_byte: float
    optimizer_numel: int = 0  # this rank's trained elements: the host's optimizer step
    s_per_optimizer_element: float = 0.0


def step_time(profile, plan: Sequence, micro_batches: int, rest_flops: float, tflops: float,
              tokens_per_micro: int, gpus_per_node: int,
              all_to_all_bytes_per_s: Optional[float] = None,
              offload_s_per_byte: Optional[float] = None,
              offload_min_bytes: Optional[int] = None,
              host_link: Optional[HostLink] = None) -> StepTime:
    """The step of `plan` over `profile` (see the module docstring). rest_flops and
    tokens_per_micro: one micro-batch's, on this rank. all_to_all_bytes_per_s: where the
    profile has Ulysses' exchange (None: no sequence parallelism). host_link: what
    sharding.cpu_offload copies per micro-batch (None: it is off)."""
    from checkpointing.planner.memory import moved_bytes

    per_flop = 1.0 / (tflops * 1e12)
    forward = attention = frozen = recompute = tiles = sent = offload = linked = 0.0
    link = host_link or HostLink((0,) * len(plan), 0, 0.0)
    for measure, step, copies in zip(profile.blocks, plan, link.block_bytes, strict=True):
        forward += measure.forward_flops
        attention += measure.attention_flops
        frozen += measure.frozen_flops
        recompute += measure.recompute_flops[step.recompute]
        tiles += measure.tile_flops
        exchanges = 2 + (step.recompute != "none")
        sent += exchanges * profile.sent_bytes_per_block
        block_s, moved_s = measure.step_flops() * per_flop, 0.0
        if offload_s_per_byte and offload_min_bytes is not None and step.offload != "none":
            moved_s = moved_bytes(measure, step, offload_min_bytes) * offload_s_per_byte
        offload += max(0.0, moved_s - block_s)
        # cpu_offload's copies share the link: what they add beyond the offload's own
        linked += (max(0.0, moved_s + copies * link.s_per_byte - block_s)
                   - max(0.0, moved_s - block_s))
    linked += link.root_bytes * link.s_per_byte
    backward = 2 * forward + 0.5 * attention - frozen
    n = micro_batches
    compute_s = (forward + backward + recompute + tiles + rest_flops) * n * per_flop
    a2a_s = sent * n / all_to_all_bytes_per_s if all_to_all_bytes_per_s and sent else 0.0
    host_step_s = link.optimizer_numel * link.s_per_optimizer_element
    return StepTime(forward_flops=forward * n, backward_flops=backward * n,
                    recompute_flops=recompute * n, tile_flops=tiles * n,
                    rest_flops=rest_flops * n, attention_flops=attention * n, tflops=tflops,
                    compute_s=compute_s, all_to_all_bytes=sent * n,
                    all_to_all_bytes_per_s=all_to_all_bytes_per_s if sent else None,
                    all_to_all_s=a2a_s, offload_s=offload * n,
                    step_s=compute_s + a2a_s + (offload + linked) * n + host_step_s,
                    tokens_per_rank=tokens_per_micro * n, gpus_per_node=gpus_per_node,
                    host_link_bytes=(sum(link.block_bytes) + link.root_bytes) * n,
                    host_link_s=linked * n, host_optimizer_numel=link.optimizer_numel,
                    host_optimizer_s=host_step_s)


def step_lines(t: StepTime) -> list[str]:
    """The report's lines on a step's time."""
    pf = 1e-15
    lines = [f"step time: {t.step_s:,.1f} s per optimizer step = {t.total_flops * pf:,.2f} PFLOP "
             f"at a nominal {t.tflops:g} TFLOP/s per GPU (--tflops; not measured): compute "
             f"{t.compute_s:,.1f} s"
             + (f" + all-to-all {t.all_to_all_s:,.1f} s ({t.all_to_all_bytes / 2**30:,.1f} GiB "
                f"sent at {t.all_to_all_bytes_per_s / 1e9:g} GB/s, not overlapped)"
                if t.all_to_all_bytes_per_s else "")
             + (f" + offload not hidden {t.offload_s:,.1f} s" if t.offload_s else "")
             + (f" + sharding.cpu_offload copies not hidden {t.host_link_s:,.1f} s "
                f"({t.host_link_bytes / 2**30:,.1f} GiB of parameters in and gradients out)"
                f" + host optimizer step {t.host_optimizer_s:,.1f} s (AdamW over "
                f"{t.host_optimizer_numel / 1e6:,.1f} M elements at a nominal "
                f"{t.host_optimizer_s / max(t.host_optimizer_numel, 1) * 1e9:.2g} ns each, "
                "not measured)"
                if t.host_link_bytes or t.host_optimizer_numel else ""),
             f"  PFLOP: forward {t.forward_flops * pf:,.2f} (attention, causal: "
             f"{t.attention_flops * pf:,.2f}), backward {t.backward_flops * pf:,.2f}, recompute "
             f"{t.recompute_flops * pf:,.2f}, tile re-forwards {t.tile_flops * pf:,.2f}, "
             f"embedding/head/loss {t.rest_flops * pf:,.2f}",
             f"  tokens per second: {t.tokens_per_s_per_rank:,.1f} per rank, "
             f"{t.tokens_per_s_per_node:,.0f} per node of {t.gpus_per_node} "
             f"({t.tokens_per_rank:,} tokens per rank per step)"]
    return lines
