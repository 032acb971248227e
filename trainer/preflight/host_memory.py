"""Host memory as a limit, like device memory: what a node pins, against the node less a reserve.

A rank pins host memory for two things the planner knows:
- offloaded activations (offload=cpu on a GPU): every saved storage of at least
  offload.min_bytes of an offloaded block waits in the pinned pool between forward and backward.
  The pool (offload/cuda.py's PinnedPool) pins each buffer at the size asked for, rounded up to a
  page (it pins ordinary memory itself: torch's pinned allocator would round to a power of two,
  a storage of 5 GiB pinning 8 GiB): the sum of these *classes* is what the node loses, never
  more than the pool's bound offload.max_host_bytes;
- sharding.cpu_offload: the sharded parameters, gradients and optimizer state.

The node also runs its OS, one process per rank (CUDA context, Python, the data loader), the page
cache and checkpoint staging, which no model here counts: `train.host_reserve_gib` (default 10%
of the node) is left out, as train.memory_reserve_gib is of each GPU.

Used by the report (its host verdict, `host_fits`) and the trainer at start (`check_node`: one
line naming the key before training when the planned pinned bytes exceed the node).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from trainer.config import Config, ConfigError

GIB = 2 ** 30
DEFAULT_RESERVE_FRACTION = 0.10  # of the node, when train.host_reserve_gib is null


def size_class(nbytes: int) -> int:
    """The pinned pool's buffer for a storage of `nbytes` (offload/cuda.py)."""
    from offload.cuda import size_class as pool_class

    return pool_class(nbytes)


def reserve_bytes(host_bytes: int, reserve_gib: Optional[float],
                  host_key: str = "--host-memory-gib") -> int:
    """train.host_reserve_gib in bytes (null: 10% of the node); refuses a reserve that leaves
    nothing of the host."""
    reserve = (int(host_bytes * DEFAULT_RESERVE_FRACTION) if reserve_gib is None
               else int(reserve_gib * GIB))
    if reserve >= host_bytes:
        raise ConfigError("train.host_reserve_gib", f"{reserve / GIB:.1f} GiB leaves nothing of "
                          f"the host's {host_bytes / GIB:.1f} GiB ({host_key}); lower it")
    return reserve


def pinned_activation_bytes(outcome) -> int:
    """Pinned bytes one rank's pool allocates for its offloaded activations: the size classes
    of every storage it moves (all out at the end of a micro-batch's forward), at most the pool's
    bound. 0 where nothing is pinned (offload=disk, or a CPU run that keeps them in place)."""
    cfg = outcome.scenario.cfg
    if not outcome.estimate.host_activations:  # the planner counts only what moves to the host
        return 0
    min_bytes = cfg.offload.min_bytes
    total = 0
    for measure, step in zip(outcome.profile.blocks, outcome.plan, strict=True):
        if step.offload == "none":
            continue
        total += sum(size_class(n) for n in measure.storage_sizes.get(step.recompute, ())
                     if n >= min_bytes)
    return min(total, cfg.offload.max_host_bytes)


@dataclass(frozen=True)
class HostVerdict:
    per_rank: int  # pinned: pool classes + cpu_offload state
    per_node: int
    host: Optional[int]  # the node's memory (--host-memory-gib), None: not judged
    reserve: int
    activations: int  # of per_rank: the pool's classes
    exact_activations: int  # what the planner counts the offloaded storages at

    @property
    def usable(self) -> Optional[int]:
        return None if self.host is None else self.host - self.reserve

    @property
    def fits(self) -> Optional[bool]:
        """None where nothing is pinned or the host is not given (not judged)."""
        if self.host is None or not self.per_node:
            return None if self.host is None else True
        return self.per_node <= self.usable


def host_verdict(outcome, host: Optional[int], reserve_gib: Optional[float]) -> HostVerdict:
    est, sc = outcome.estimate, outcome.scenario
    activations = pinned_activation_bytes(outcome)
    per_rank = activations + est.host
    reserve = reserve_bytes(host, reserve_gib) if host is not None else 0
    return HostVerdict(per_rank, per_rank * sc.gpus_per_node, host, reserve, activations,
                       est.host_activations)


def host_lines(v: HostVerdict) -> list[str]:
    """The report's host verdict: pinned per node against the node less its reserve."""
    if not v.per_node:
        return []
    what = (f"{v.per_node / GIB:.2f} GiB pinned per node ({v.per_rank / GIB:.2f} per rank: "
            f"offloaded activations {v.activations / GIB:.2f} GiB as the pool pins them (to a "
            f"page), {v.exact_activations / GIB:.2f} GiB exact"
            + (f", sharding.cpu_offload state {(v.per_rank - v.activations) / GIB:.2f} GiB"
               if v.per_rank > v.activations else "") + ")")
    if v.host is None:
        return [f"host memory not judged: {what}; pass --host-memory-gib"]
    room = (f"{v.usable / GIB:.2f} GiB usable of {v.host / GIB:.2f} GiB (train.host_reserve_gib "
            f"{v.reserve / GIB:.2f} GiB left to the OS, processes, page cache)")
    if v.fits:
        return [f"host memory fits: {what}; {room}"]
    return [f"does NOT fit in host memory: {what}; {room}; lower offload.max_host_bytes or "
            "offload fewer blocks (offload.keep_last), or take more nodes"]


def node_memory_bytes() -> int:
    """This machine's physical memory (Linux, macOS)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_node(cfg: Config, layout, gpus_per_node: int, device_type: str,
               node_bytes: Optional[int] = None) -> None:
    """At start: refuse in one line (ConfigError) a plan whose pinned host memory per node
    exceeds the node less train.host_reserve_gib. Only a GPU run pins; the pool's bound
    (offload.max_host_bytes per rank) within the node needs no plan, else the planner's own
    prediction of this config decides (checkpointing=auto decides its plan later)."""
    o = cfg.offload
    pins = (o.target == "cpu" or cfg.sharding.cpu_offload) and device_type == "cuda"
    if not pins:
        return
    node = node_memory_bytes() if node_bytes is None else node_bytes
    usable = node - reserve_bytes(node, cfg.train.host_reserve_gib, "the node's memory")
    bound = o.max_host_bytes if o.target == "cpu" else 0
    if not cfg.sharding.cpu_offload and bound * gpus_per_node <= usable:
        return
    if cfg.checkpointing.policy == "auto" or layout.micro_batch == "auto":
        return
    from trainer.preflight.scenario import Evaluator, Scenario

    outcome = Evaluator(1.0, device_type="cuda").evaluate(Scenario(cfg, layout, gpus_per_node))
    v = host_verdict(outcome, node, cfg.train.host_reserve_gib)
    if not v.fits:
        raise ConfigError("offload.max_host_bytes", f"this plan pins {v.per_node / GIB:.1f} GiB "
                          f"of host memory per node ({gpus_per_node} ranks x "
                          f"{v.per_rank / GIB:.1f} GiB), more than the node's "
                          f"{node / GIB:.1f} GiB less train.host_reserve_gib "
                          f"({v.reserve / GIB:.1f} GiB); lower offload.max_host_bytes, offload "
                          "fewer blocks or recompute more")
