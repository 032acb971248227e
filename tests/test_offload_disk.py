"""The disk store on CPU: memory really freed, files really gone, clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from offload.disk import FOLDER_PREFIX, DiskStore, check_writable, host_tag
from offload.engine import OffloadError, Offloader
from offload.files import hold
from offload.heap import can_release, release_free_heap
from tests.helpers import REPO
from tests.test_offload_engine import MIN_BYTES, Toy, batch, wrap_blocks


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_disk_offload_really_frees_memory(tmp_path) -> None:
    store = DiskStore(str(tmp_path), "cpu", max_inflight_bytes=1 << 30)
    offloader = Offloader(store, MIN_BYTES)
    x = torch.randn(16 << 20, requires_grad=True)  # 64 MiB
    refs = []
    with offloader:
        offloader.begin_step()
        before = _rss_bytes()
        with offloader.block_context(0):
            y = x.exp()  # saves its output: its only reference once we drop `y`
            refs.append(StorageWeakRef(y.untyped_storage()))
            loss = y.sum()
            del y
        store.flush()
        assert refs[0].expired()  # written, and nobody holds it any more
        assert _rss_bytes() - before < 16 << 20  # the 64 MiB are not resident
        assert [os.path.getsize(os.path.join(store.folder, f))
                for f in os.listdir(store.folder)] == [64 << 20]
        loss.backward()
        assert torch.equal(x.grad, x.detach().exp())
        assert os.listdir(store.folder) == []  # read back: deleted
        offloader.end_step()
    assert os.listdir(tmp_path) == []


def test_forward_waits_for_the_writer_beyond_the_inflight_bound(tmp_path) -> None:
    torch.manual_seed(0)
    model = Toy()
    store = DiskStore(str(tmp_path), "cpu", max_inflight_bytes=20 << 10,
                      before_write=lambda: time.sleep(0.005))
    offloader = Offloader(store, MIN_BYTES)
    wrap_blocks(model.blocks, offloader, recompute=False)
    with offloader:
        offloader.begin_step()
        model(batch(0)).backward()
        offloader.end_step()
    # Storages are 8 or 16 KiB: without the bound, all 20 would wait for the slow writer.
    assert 16 << 10 <= store.peak_inflight_bytes <= 20 << 10
    assert store.bytes_written > 0


def test_nothing_left_on_disk_when_a_step_raises(tmp_path) -> None:
    torch.manual_seed(0)
    model = Toy()
    store = DiskStore(str(tmp_path), "cpu", before_write=lambda: time.sleep(0.01))
    offloader = Offloader(store, MIN_BYTES)
    wrap_blocks(model.blocks, offloader, recompute=False)

    def fail(module, args):
        raise ValueError("boom")

    model.blocks[2].register_forward_pre_hook(fail)
    with pytest.raises(ValueError, match="boom"):
        with offloader:
            offloader.begin_step()
            model(batch(0))
    assert os.listdir(tmp_path) == []
    assert not store._writer.is_alive() and not store._reader.is_alive()


def test_stale_folders_of_dead_processes_are_removed(tmp_path) -> None:
    # A rank killed with kill -9 and not yet reaped by its launcher: its pid still answers
    # (a zombie), but the lock it held on its folder is gone.
    code = ("import sys, time; from offload.disk import DiskStore; "
            f"s = DiskStore({str(tmp_path)!r}, 'cpu'); print(s.folder, flush=True); "
            "time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    stale = Path(child.stdout.readline().strip())
    (stale / "0.bin").write_bytes(b"x")
    child.kill()
    time.sleep(0.5)
    os.kill(child.pid, 0)  # still answers: not reaped
    alive = tmp_path / f"{FOLDER_PREFIX}{host_tag()}-{os.getpid()}-beef"
    other_host = tmp_path / f"{FOLDER_PREFIX}elsewhere-{child.pid}-abcd"
    for folder in (alive, other_host):
        folder.mkdir()
        (folder / "0.bin").write_bytes(b"x")
    held = hold(str(alive))  # a live run's folder, as every DiskStore holds its own
    store = DiskStore(str(tmp_path), "cpu")
    try:
        assert store.removed_stale == [str(stale)]
        assert not stale.exists() and alive.exists() and other_host.exists()
    finally:
        store.close()
        os.close(held)
        child.wait()


def test_unwritable_or_full_dir_is_a_clear_error(tmp_path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(OffloadError, match="^offload.dir: .* is not writable"):
        DiskStore(str(blocker / "sub"), "cpu")
    with pytest.raises(OffloadError, match="^offload.dir: .* bytes free"):
        check_writable(str(tmp_path), need_bytes=1 << 62)
    check_writable(str(tmp_path), need_bytes=1)


def test_failed_write_is_a_clear_error(tmp_path) -> None:
    def disk_full() -> None:
        raise OSError(28, "No space left on device")

    store = DiskStore(str(tmp_path), "cpu", before_write=disk_full)
    offloader = Offloader(store, MIN_BYTES)
    torch.manual_seed(0)
    model = Toy()
    wrap_blocks(model.blocks, offloader, recompute=False)
    message = "^offload.dir: no space left in .* while offloading activations; point offload.dir"
    with offloader:
        offloader.begin_step()
        with pytest.raises(OffloadError, match=message):
            loss = model(batch(0))  # raises here when the writer failed before the end...
            store.flush()  # ...else every write has failed now, none is served from memory
            loss.backward()
        offloader.begin_step()
        with pytest.raises(OffloadError, match=message):
            model(batch(1))  # the first save of the next step fails at once
    assert os.listdir(tmp_path) == []


def _mapped(path_part: str) -> bool:
    with open("/proc/self/maps") as f:
        return any(path_part in line for line in f)


def test_cpu_restore_is_a_file_mapping_unmapped_when_released(tmp_path) -> None:
    # Restored data must not come out of the heap: freed heap memory stays resident.
    store = DiskStore(str(tmp_path), "cpu")
    data = torch.randint(0, 256, (8 << 20,), dtype=torch.uint8)
    with store:
        ticket = store.put(data.clone(), group=0)
        store.flush()
        restored = store.get(ticket)
        assert torch.equal(restored, data)
        assert _mapped(store.folder) and os.listdir(store.folder) == []  # mapped, file unlinked
        store.release(ticket)
        del restored
        store.end_step()
        assert not _mapped(store.folder)


def test_heap_is_trimmed_once_per_micro_batch_as_backward_starts(tmp_path) -> None:
    store = DiskStore(str(tmp_path), "cpu", trim_heap=True)
    offloader = Offloader(store, MIN_BYTES)
    torch.manual_seed(0)
    model = Toy()
    wrap_blocks(model.blocks, offloader, recompute=False)
    with offloader:
        for step in range(2):
            offloader.begin_step()
            model(batch(step)).backward()
            offloader.end_step()
    assert store.heap_trims == (2 if can_release() else 0)
    assert store.bytes_read > 0 and os.listdir(tmp_path) == []


def test_trim_gives_freed_heap_pages_back() -> None:
    if not can_release():
        pytest.skip("the C library has no malloc_trim (not glibc)")
    # 64 KiB tensors sit in the heap (under glibc's mmap threshold); keeping every 8th pins the
    # heap's top, so freeing the others leaves holes glibc will not return by itself.
    tensors = [torch.ones(16 << 10) for _ in range(2048)]  # 128 MiB
    keep = tensors[7::8]
    del tensors
    before = _rss_bytes()
    assert release_free_heap()
    assert before - _rss_bytes() > 32 << 20
    assert all(float(t[0]) == 1.0 for t in keep)


@pytest.mark.parametrize("offload", ["disk", "none"])
def test_any_restart_removes_every_stale_offload_folder_of_the_run(tmp_path, offload) -> None:
    """Issue 27 item 9: rank 1 of a 2-rank run was killed with kill -9 and left its folder; a
    restart on one process (rank 0 only), with or without the disk tier, removes it."""
    from tests.helpers import QUICK, check_ok, run_trainer

    run_dir = tmp_path / "run"
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid no process holds any more
    stale = run_dir / "offload" / "rank1" / f"{FOLDER_PREFIX}{host_tag()}-{dead.pid}-abcd1234"
    stale.mkdir(parents=True)
    (stale / "0.bin").write_bytes(b"x" * (1 << 20))
    tier = (["offload=disk", "checkpointing=full", "offload.min_bytes=0"] if offload == "disk"
            else [])
    result = run_trainer([*QUICK, "data=synthetic", "train.steps=2", *tier,
                          f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    check_ok(result)
    assert not (run_dir / "offload" / "rank1").exists()
    assert ("removed the offload files of processes that ended without removing them: "
            f"{stale}") in result.stdout + result.stderr
