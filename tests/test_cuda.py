"""CUDA paths: NCCL, one GPU per local rank, bf16 mixed precision, MFU. Skipped without a GPU."""

from __future__ import annotations

import pytest

from tests.helpers import QUICK, check_ok, read_metrics, run_trainer, layout_of


@pytest.mark.cuda
def test_cuda_training_reports_mfu(tmp_path) -> None:
    import torch

    nproc = min(2, torch.cuda.device_count())
    run_dir = tmp_path / "run"
    check_ok(run_trainer(QUICK + ["train.steps=4", "sharding.param_dtype=bfloat16",
                                  "sharding.reduce_dtype=float32", f"hydra.run.dir={run_dir}"],
                         cwd=tmp_path, nproc=nproc))
    logged = [m for m in read_metrics(run_dir) if "loss" in m]
    assert len(logged) == 4
    # peak_mem_bytes is the CUDA allocator's high-water mark, far below a process's RSS.
    assert all(0 < m["peak_mem_bytes"] < 2**30 for m in logged)
    if any(k in torch.cuda.get_device_name() for k in ("H100", "H200", "A100")):
        assert all(0 < m["mfu"] < 1 for m in logged)


@pytest.mark.cuda
def test_fsdp_cpu_offload_matches_device_resident(tmp_path) -> None:
    """sharding.cpu_offload keeps shards, grads and optimizer state in CPU memory; same maths."""
    import torch

    from tests.helpers import losses

    nproc = min(2, torch.cuda.device_count())
    runs = {}
    for name, extra in (("resident", []), ("offloaded", ["sharding.cpu_offload=true"])):
        run_dir = tmp_path / name
        check_ok(run_trainer(QUICK + ["train.steps=4", f"hydra.run.dir={run_dir}", *extra],
                             cwd=tmp_path, nproc=nproc))
        runs[name] = losses(run_dir)
    assert runs["offloaded"] == pytest.approx(runs["resident"], rel=1e-5)


@pytest.mark.cuda
def test_building_leaves_no_peak_behind(monkeypatch) -> None:
    """Profiling runs blocks unsharded under every option; after the build the allocator's peak
    starts again from what the run holds, and its cache is handed back (issue 29, item 1)."""
    import torch

    from checkpointing.meter import SavedBytesMeter
    from tests.helpers import config
    from trainer.build import build_model
    from trainer.distenv import read_env

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    cfg = config("checkpointing=full", "sharding=none", "data.seq_len=512",
                 "train.micro_batch_size=8", "train.device=cuda")
    built = build_model(cfg, read_env("cuda"), layout=layout_of(cfg), meter=SavedBytesMeter())
    device = next(built.model.parameters()).device
    assert torch.cuda.max_memory_allocated(device) == torch.cuda.memory_allocated(device)
    assert torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device) < 64 * 2**20
