"""Full disks: a checkpoint that does not fit, and the offload disk tier running out of room.

Each test mounts a small tmpfs (root only; skipped elsewhere with the reason), so the disk
really fills: no write is faked."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.helpers import QUICK, check_ok, run_trainer, small_tmpfs, step_losses

RUN = QUICK + ["data=synthetic", "train.steps=6", "save.every=2", "save.keep=2"]
CHECKPOINT_MIB = 11  # one checkpoint of this tiny run: model, AdamW state, RNG, state.json


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of 16 MiB: room for one checkpoint of RUN, not for two."""
    with small_tmpfs(tmp_path / "small", "16m") as mount:
        yield mount


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_checkpoint_that_does_not_fit_stops_cleanly_and_resumes_exactly(
        tmp_path, small_disk, async_save) -> None:
    reference = tmp_path / "reference"
    check_ok(run_trainer(RUN + [f"hydra.run.dir={reference}"], cwd=tmp_path))
    run_dir = tmp_path / "run"
    overrides = RUN + [f"save.dir={small_disk}", f"save.async_save={str(async_save).lower()}",
                       f"hydra.run.dir={run_dir}"]
    result = run_trainer(overrides, cwd=tmp_path)
    assert result.returncode == 74, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and lines[-1] == (
        f"error: save.dir: no space left on {small_disk} while saving step 4 to "
        f"{small_disk}/step_00000004; the last good checkpoint is step 2. Free space (or set "
        "save.dir elsewhere) and start the same run again to continue from it")
    assert sorted(p.name for p in small_disk.iterdir()) == ["step_00000002"]  # no torn folder
    assert lines[-1] in (run_dir / "train.log").read_text()
    # Space freed: the same run continues from step 2 and ends as if never stopped.
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    check_ok(run_trainer(overrides, cwd=tmp_path))
    assert step_losses(run_dir) == step_losses(reference)


def test_the_disk_tier_running_out_of_room_is_one_line_and_leaves_no_file(
        tmp_path, small_disk) -> None:
    subprocess.run(["mount", "-o", "remount,size=1m", str(small_disk)], check=True)
    result = run_trainer(QUICK + ["data=synthetic", "train.steps=2", "offload=disk",
                                  f"offload.dir={small_disk}", "offload.min_bytes=0",
                                  "train.micro_batch_size=32", f"hydra.run.dir={tmp_path / 'run'}"],
                         cwd=tmp_path)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and lines[-1].startswith(
        f"error: offload.dir: no space left in {small_disk}/rank0 while offloading activations")
    assert list(Path(small_disk).rglob("*.bin")) == [] and not any(
        p.is_file() for p in Path(small_disk).rglob("*"))
