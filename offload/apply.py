"""Carrying out the offload part of the plan: hooks around each planned block, one store per run.

The hooks wrap the block's (possibly checkpointed) forward on its instance, so for a recomputed
block they see exactly the checkpoint's inputs and for a kept block everything it saves; both sit
inside `fully_shard`'s hooks. The store is built once per run and reused every step.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from checkpointing.plan import BlockPlan
from checkpointing.meter import SavedBytesMeter
from offload.disk import DiskStore, cleanup_stale
from offload.engine import Offloader
from offload.host import NOTHING_TO_MOVE, CpuStore

log = logging.getLogger("trainer")


def build_offloader(target: str, device: torch.device, min_bytes: int, max_host_bytes: int,
                    directory: str, max_inflight_bytes: int, is_main: bool,
                    trim_heap: bool = False) -> Optional[Offloader]:
    if target == "none":
        return None
    if target == "cpu":
        store = CpuStore(device, max_host_bytes)
        if not store.moves_data and is_main:
            log.warning(NOTHING_TO_MOVE + " (the hooks still run)")
    else:
        # One folder per rank under offload.dir; the store adds a per-process subfolder.
        store = DiskStore(directory, device, max_inflight_bytes, trim_heap=trim_heap)
        if is_main:
            log.info("offload.target=disk: saved activations go to %s", directory)
    return Offloader(store, min_bytes)


def _offloaded_forward(original: Callable, offloader: Offloader, index: int,
                       meter: Optional[SavedBytesMeter], *args, **kwargs):
    on_device = meter.add if meter is not None and meter.active else None
    with offloader.block_context(index, on_device=on_device):
        return original(*args, **kwargs)


def apply_offload(blocks: Sequence[nn.Module], plan: Sequence[BlockPlan],
                  offloader: Optional[Offloader], meter: Optional[SavedBytesMeter]) -> None:
    if offloader is None:
        return
    for index, (block, block_plan) in enumerate(zip(blocks, plan, strict=True)):
        if block_plan.offload != "none":
            block.forward = functools.partial(_offloaded_forward, block.forward, offloader, index,
                                              meter)


def offload_micro_batch(offloader: Optional[Offloader]) -> contextlib.AbstractContextManager:
    """Around one micro-batch's forward and backward: afterwards every moved tensor is back and
    released (files deleted, pool slots free), also when the step raised. With offload off,
    nothing (not even a generator's frames)."""
    return contextlib.nullcontext() if offloader is None else _offloading(offloader)


@contextlib.contextmanager
def _offloading(offloader: Offloader) -> Iterator[None]:
    offloader.begin_step()
    try:
        yield
    finally:
        offloader.end_step()


def close_offloader(offloader: Optional[Offloader], own_parent: bool = True) -> None:
    """End the run's offloading: threads joined, files and the folders we made removed.

    own_parent: the folder above the rank folder is ours (the default <run dir>/offload) and
    goes too when empty; a user's offload.dir stays.
    """
    if offloader is None:
        return
    folder = getattr(offloader.store, "folder", None)
    offloader.close()
    if folder is not None:  # the store removed its own subfolder; the rank folder is ours
        rank_folder = os.path.dirname(folder)
        with contextlib.suppress(OSError):
            os.rmdir(rank_folder)
            if own_parent:
                os.rmdir(os.path.dirname(rank_folder))


def offload_dir(configured: Optional[str], run_dir: str, rank: int) -> str:
    return os.path.join(offload_root(configured, run_dir), f"rank{rank}")


def offload_root(configured: Optional[str], run_dir: str) -> str:
    return configured or os.path.join(run_dir, "offload")


def remove_stale_offload(configured: Optional[str], run_dir: str, world_size: int) -> list[str]:
    """Every rank folder's stale disk-tier files on this host (those whose process ended in
    any way, e.g. kill -9, without removing them), whatever the world size that wrote them: a
    rank's own store cleans only its own folder, and a restart on fewer ranks has no store for
    the others. Live folders are locked and stay. Empty folders of ranks this run does not
    have go too (in the run's own offload folder). Returns what was removed."""
    root = offload_root(configured, run_dir)
    try:
        names = sorted(n for n in os.listdir(root) if n.startswith("rank") and n[4:].isdigit())
    except OSError:  # no offload folder yet
        return []
    removed = []
    for name in names:
        folder = os.path.join(root, name)
        removed += cleanup_stale(folder)
        if configured is None and int(name[4:]) >= world_size:  # the run's own offload folder
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # only when empty: no rank of this run writes there
    return removed
