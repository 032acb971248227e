"""Saved-activation offload on CPU: it moves memory, never the maths.

Every block's forward runs under `Offloader.block_context`; gradients must be bitwise those of the
same model without hooks, with dropout on, with and without checkpointing, for the CPU store (the
full hook path, nothing moved) and the disk store (really written and read back).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from offload.disk import DiskStore
from offload.engine import Offloader
from offload.host import CpuStore
from tests.dist import spawn

DIM, HIDDEN, BATCH, SEQ = 32, 64, 4, 16
MIN_BYTES = 1024


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1, self.fc2 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.norm(x)))))


class Toy(nn.Module):
    def __init__(self, n_blocks: int = 4, block: Callable[[], nn.Module] = Block) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(n_blocks))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).square().mean()


def wrap_blocks(blocks: nn.ModuleList, offloader: Optional[Offloader], recompute: bool) -> None:
    """What the trainer does per block: hooks outside, checkpoint inside."""
    for index, block in enumerate(blocks):
        original = block.forward

        def forward(*args, _original=original, _index=index, **kwargs):
            hooks = offloader.block_context(_index) if offloader else contextlib.nullcontext()
            with hooks:
                if recompute:
                    return checkpoint(_original, *args, use_reentrant=False, **kwargs)
                return _original(*args, **kwargs)

        block.forward = forward


def batch(step: int, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, SEQ, DIM, generator=generator).to(device)


def train(store: Optional[object], recompute: bool, steps: int = 3, device: str = "cpu",
          make_model: Callable[[], nn.Module] = Toy, min_bytes: int = MIN_BYTES,
          after_step: Callable[[int], None] = lambda step: None):
    """(per-step gradients, per-step stats) of a few SGD steps with every block offloaded."""
    torch.manual_seed(0)
    model = make_model().to(device)
    offloader = Offloader(store, min_bytes) if store is not None else None
    wrap_blocks(model.blocks, offloader, recompute)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)  # dropout masks: the same sequence with and without offload
    grads, stats = [], []
    try:
        for step in range(steps):
            if offloader:
                offloader.begin_step()
            model(batch(step, device)).backward()
            if offloader:
                offloader.end_step()
                stats.append(offloader.stats)
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
            optimizer.step()
            optimizer.zero_grad()
            after_step(step)
    finally:
        if offloader:
            offloader.close()
    return grads, stats


def assert_bitwise(grads, ref) -> None:
    assert len(grads) == len(ref)
    for step, (got, want) in enumerate(zip(grads, ref)):
        for name in want:
            assert torch.equal(got[name], want[name]), (step, name)


STORES = {"cpu": lambda tmp: CpuStore("cpu", max_host_bytes=1 << 30),
          # A small in-flight bound: forward really waits for the writer now and then.
          "disk": lambda tmp: DiskStore(str(tmp), "cpu", max_inflight_bytes=32 << 10)}


@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "checkpoint"])
@pytest.mark.parametrize("target", list(STORES))
def test_gradients_bitwise_identical(target: str, recompute: bool, tmp_path) -> None:
    ref, _ = train(None, recompute)
    grads, stats = train(STORES[target](tmp_path), recompute)
    assert_bitwise(grads, ref)
    assert all(s.moved_count > 0 and s.forced_releases == 0 for s in stats)
    if recompute:
        # Under checkpoint the hooks see only the checkpoint's inputs: one activation per block.
        # (torch 2.11's checkpoint also saves an empty placeholder per block: kept, 0 bytes.)
        assert all(s.offloaded_bytes == 4 * BATCH * SEQ * DIM * 4 for s in stats)
        assert all(s.moved_count == 4 and s.saved_count == 4 + s.kept_count for s in stats)
        assert all(s.kept_bytes == 0 for s in stats)
    else:
        assert all(s.excluded_count > 0 and s.kept_count > 0 for s in stats)
    assert all(s.prefetched_groups == 3 for s in stats)  # every block but the last in backward
    assert os.listdir(tmp_path) == []  # the disk store removed its folder at close


class Views(nn.Module):
    """Saves one storage through several views, and hands it to the next block too."""

    def __init__(self) -> None:
        super().__init__()
        self.w_cols = nn.Parameter(torch.randn(8))
        self.w_t = nn.Parameter(torch.randn(BATCH * SEQ, 4))
        self.w_all = nn.Parameter(torch.randn(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2.0  # y's storage: saved below as y[..., :8], y.t() and y itself
        flat = y.reshape(BATCH * SEQ, DIM)
        a = (y[..., :8] * self.w_cols).sum()
        b = (flat.t() @ self.w_t).sum()
        c = y * self.w_all
        return c + (a + b) * 1e-3


def test_views_of_one_storage_move_once(tmp_path) -> None:
    for target, make in STORES.items():
        ref, _ = train(None, False, make_model=lambda: Toy(2, Views))
        grads, stats = train(make(tmp_path), False, make_model=lambda: Toy(2, Views))
        assert_bitwise(grads, ref)
        for s in stats:
            # Per block y is saved 3 times (`x * 2.0` saves nothing): 2 storages, 4 found stored.
            assert (s.moved_count, s.dedup_count) == (2, 4), (target, s)
            assert s.offloaded_bytes == 2 * BATCH * SEQ * DIM * 4


class SavesInput(nn.Module):
    """Saves its input: block 1 saves what block 0 also saved (its output, as sigmoid's)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.w).sigmoid()


def test_storage_saved_by_two_blocks_moves_once(tmp_path) -> None:
    ref, _ = train(None, False, make_model=lambda: Toy(3, SavesInput))
    grads, stats = train(STORES["disk"](tmp_path), False, make_model=lambda: Toy(3, SavesInput))
    assert_bitwise(grads, ref)
    # Block i saves its input and its sigmoid output, which block i+1 saves again as its input.
    assert all(s.dedup_count == 2 and s.moved_count == 4 for s in stats), stats


class InPlaceAfterSave(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.w = nn.Parameter(torch.randn(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "legal":  # relu_ saves its own output after the write: fine
            y = F.relu(x * self.w, inplace=True)
            return y * 2 + x
        if self.mode == "resave":  # saved, overwritten, saved again: the first never used
            y = x * self.w
            self.unused = y * self.w  # keeps the first save alive, outside the loss
            y.add_(1)
            return y * self.w
        y = (x * self.w).sigmoid()  # sigmoid saves y...
        z = y * 2
        y.mul_(3)  # ...which is then overwritten: backward must refuse
        return z + y


INPLACE_ERROR = ("one of the variables needed for gradient computation has been modified by an "
                 "inplace operation")


def _inplace_outcome(store: Optional[object], mode: str, device: str = "cpu"):
    """The gradients, or the error message."""
    try:
        return train(store, False, steps=1, device=device,
                     make_model=lambda: Toy(2, lambda: InPlaceAfterSave(mode)))[0]
    except RuntimeError as error:
        return str(error)


def test_pytorch_does_not_check_tensors_saved_through_hooks() -> None:
    """Why the engine checks versions itself: with hooks, autograd silently uses whatever the
    unpack hook returns (here the overwritten tensor), where without hooks it raises."""
    x = torch.randn(4, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        y = x.sigmoid()
        z = y * 2
        y.mul_(3)
    z.sum().backward()  # no error: the gradient is computed from 3 * sigmoid(x)
    expected = 2 * (3 * x.sigmoid()) * (1 - 3 * x.sigmoid())
    assert torch.allclose(x.grad, expected.detach())


@pytest.mark.parametrize("target", ["cpu", "disk", "disk-slow-writer"])
def test_inplace_after_save_behaves_as_without_offload(target: str, tmp_path) -> None:
    def make_store():
        if target == "disk-slow-writer":  # writes happen well after the in-place ops
            return DiskStore(str(tmp_path), "cpu", before_write=lambda: time.sleep(0.05))
        return STORES[target](tmp_path)

    for mode in ("legal", "resave"):
        assert_bitwise(_inplace_outcome(make_store(), mode), _inplace_outcome(None, mode))
    expected = _inplace_outcome(None, "illegal")
    # A slow writer writes the overwritten data; the version check refuses it anyway.
    got = _inplace_outcome(make_store(), "illegal")
    assert isinstance(got, str) and got.startswith(INPLACE_ERROR), got
    assert isinstance(expected, str) and expected.startswith(INPLACE_ERROR)
    assert os.listdir(tmp_path) == []


def test_storage_overwritten_after_save_is_stored_again(tmp_path) -> None:
    # Per block: x, y before add_ and y after: the second save of y must not find the first.
    _, stats = train(STORES["disk"](tmp_path), False, steps=1,
                     make_model=lambda: Toy(2, lambda: InPlaceAfterSave("resave")))
    assert (stats[0].moved_count, stats[0].dedup_count) == (6, 0), stats


class SpyStore(CpuStore):
    """A CPU store that records what it was handed."""

    def __init__(self) -> None:
        super().__init__("cpu", max_host_bytes=1 << 30)
        self.data_ptrs: list[int] = []
        self.calls: list[tuple[str, int]] = []
        self._group_of: dict[int, int] = {}

    def put(self, flat, group):
        ticket = super().put(flat, group)
        self.data_ptrs.append(flat.data_ptr())
        self._group_of[id(ticket)] = group
        return ticket

    def prefetch(self, ticket) -> None:
        self.calls.append(("prefetch", self._group_of[id(ticket)]))

    def get(self, ticket):
        self.calls.append(("get", self._group_of[id(ticket)]))
        return super().get(ticket)


def test_parameters_and_small_tensors_stay() -> None:
    store = SpyStore()
    torch.manual_seed(0)
    model = Toy()
    offloader = Offloader(store, MIN_BYTES)
    wrap_blocks(model.blocks, offloader, recompute=False)
    offloader.begin_step()
    model(batch(0)).backward()
    param_ptrs = {p.data_ptr() for p in model.parameters()}
    assert store.data_ptrs and not param_ptrs & set(store.data_ptrs)
    assert offloader.stats.excluded_count >= 4 * 4  # LayerNorm weight, two Linear weights...
    assert offloader.stats.kept_count > 0  # LayerNorm's per-row mean and rstd: 256 bytes
    offloader.end_step()
    offloader.min_bytes = 1 << 30
    offloader.begin_step()
    model(batch(1)).backward()
    offloader.end_step()
    assert offloader.stats.moved_count == 0 and offloader.stats.offloaded_bytes == 0
    stats = offloader.stats
    assert stats.kept_count == stats.saved_count - stats.excluded_count


def test_prefetch_brings_back_the_next_block_before_its_backward() -> None:
    store = SpyStore()
    train(store, recompute=True, steps=1)
    # Each block's first unpack asks for the block before it, ahead of that block's backward.
    assert store.calls == [("prefetch", 3), ("prefetch", 2), ("get", 3), ("prefetch", 1),
                           ("get", 2), ("prefetch", 0), ("get", 1), ("get", 0)]


def test_retain_graph_unpacks_twice_and_end_step_releases(tmp_path) -> None:
    torch.manual_seed(0)
    model = Toy()
    offloader = Offloader(DiskStore(str(tmp_path), "cpu"), MIN_BYTES)
    wrap_blocks(model.blocks, offloader, recompute=False)
    with offloader:
        offloader.begin_step()
        loss = model(batch(0))
        loss.backward(retain_graph=True)
        first = [p.grad.clone() for p in model.parameters()]
        loss.backward(retain_graph=True)  # unpacks every saved tensor a second time
        assert all(torch.equal(2 * g, p.grad) for g, p in zip(first, model.parameters()))
        offloader.end_step()  # the graph is still alive (loss): released by force
        assert offloader.stats.forced_releases == offloader.stats.moved_count > 0
        with pytest.raises(RuntimeError, match="after end_step released it"):
            loss.backward()


def _fsdp_ranks(rank: int, world_size: int, tmp: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    results = {}
    for target, recompute in (("none", False), ("disk", False), ("disk-checkpoint", True)):
        torch.manual_seed(0)
        model = Toy()
        store = DiskStore(tmp, "cpu", max_inflight_bytes=32 << 10) if target != "none" else None
        offloader = Offloader(store, MIN_BYTES) if store else None
        wrap_blocks(model.blocks, offloader, recompute)
        mesh = init_device_mesh("cpu", (world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        torch.manual_seed(1 + rank)
        grads = []
        for step in range(2):
            if offloader:
                offloader.begin_step()
            model(batch(10 * step + rank)).backward()
            if offloader:
                offloader.end_step()
            grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
            model.zero_grad()
        if offloader:
            # Inside fully_shard the unsharded parameters are saved too: never offloaded.
            assert offloader.stats.moved_count > 0
            assert (offloader.stats.excluded_count > 0) == (not recompute)
            offloader.close()
        results[target] = grads
    return results


def test_two_ranks_fsdp_disk_bitwise(tmp_path) -> None:
    for result in spawn(_fsdp_ranks, 2, str(tmp_path)):
        assert_bitwise(result["disk"], result["none"])
        assert_bitwise(result["disk-checkpoint"], result["none"])
    assert os.listdir(tmp_path) == []
