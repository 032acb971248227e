"""What a careful read said would go wrong on the first GPU run, shown on CPU where it can be
(issue 29): profiling in the run's compute dtype and not counted as the run's peak, initial
weights drawn on the compute device whatever the parameters' home, step time that waits for
the device, and the right peak FLOP/s for an H200 NVL. The CUDA halves are in tests/test_cuda.py.
"""

from __future__ import annotations

import time

import pytest
import torch

from checkpointing.meter import SavedBytesMeter
from tests.helpers import config, layout_of
from trainer import build
from trainer.distenv import read_env
from trainer.loop import step_seconds
from trainer.observe.metrics import peak_flops_of

TINY = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_hidden=64", "model.vocab_size=256", "data.seq_len=16", "train.micro_batch_size=2"]


def test_blocks_are_profiled_in_the_param_dtype(world_of_one, monkeypatch) -> None:
    """Under sharding.param_dtype=bfloat16 FSDP computes in bf16, so profiling must too (fp32
    takes other kernels and twice the bytes); the run's own weights stay fp32."""
    seen = []
    real = build.profile_blocks

    def spy(blocks, trace, *args, **kwargs):
        seen.append({p.dtype for b in blocks for p in b.parameters()}
                    | {a.dtype for args_, _ in trace.block_args for a in args_
                       if isinstance(a, torch.Tensor) and a.is_floating_point()})
        return real(blocks, trace, *args, **kwargs)

    monkeypatch.setattr(build, "profile_blocks", spy)
    cfg = config(*TINY, "checkpointing=full", "checkpointing.profile=true", "sharding=fsdp",
                 "sharding.param_dtype=bfloat16")
    built = build.build_model(cfg, read_env("cpu"), layout=layout_of(cfg), meter=SavedBytesMeter())
    assert seen == [{torch.bfloat16}]
    assert {p.dtype for p in built.model.parameters()} == {torch.float32}
    seen.clear()
    plain = config(*TINY, "checkpointing=full", "checkpointing.profile=true")
    build.build_model(plain, read_env("cpu"), layout_of(plain), meter=SavedBytesMeter())
    assert seen == [{torch.float32}]  # no mixed precision: the model as it is
    seen.clear()
    fixed = config(*TINY, "checkpointing=full")
    build.build_model(fixed, read_env("cpu"), layout_of(fixed), meter=SavedBytesMeter())
    assert seen == []  # a fixed policy is not timed unless asked


class FakeCuda:
    def __init__(self) -> None:
        self.calls = []

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")

    def reset_peak_memory_stats(self, device) -> None:
        self.calls.append(("reset_peak_memory_stats", device.type))

    def synchronize(self, device) -> None:
        time.sleep(0.05)  # the optimizer step the device is still running
        self.calls.append(("synchronize", device.type))


def test_building_does_not_count_as_the_runs_peak() -> None:
    cuda = FakeCuda()
    build.forget_build_peak(torch.device("cpu"), cuda)
    assert cuda.calls == []
    build.forget_build_peak(torch.device("cuda", 0), cuda)
    assert cuda.calls == ["empty_cache", ("reset_peak_memory_stats", "cuda")]


def test_step_time_waits_for_the_device() -> None:
    """CUDA queues the optimizer step; the clock is read once the device has run it."""
    cuda = FakeCuda()
    started = time.perf_counter()
    assert step_seconds(started, torch.device("cuda", 0), cuda.synchronize) >= 0.05
    assert cuda.calls == [("synchronize", "cuda")]
    started = time.perf_counter()
    assert step_seconds(started, torch.device("cpu"), cuda.synchronize) < 0.05
    assert len(cuda.calls) == 1


def test_initial_values_are_drawn_on_the_compute_device(monkeypatch) -> None:
    """Under FSDP2's CPU offload the parameters live in CPU memory, but their values must come
    from the compute device's generator, as in a device-resident run (CUDA's Philox and the
    CPU's Mersenne Twister draw different numbers)."""
    drawn_on = []
    real = torch.Generator

    class Spy:
        def __new__(cls, device="cpu"):
            drawn_on.append(torch.device(device))
            return real(device="cpu")

    model = build.build_on_meta(config(*TINY).model)
    monkeypatch.setattr(build.torch, "Generator", Spy)
    compute = torch.device("cpu", 0)  # stands for the CUDA device: another device than storage
    build.materialize(model, compute, seed=3, storage=torch.device("cpu"))
    assert drawn_on and set(drawn_on) == {compute}
    assert {p.device for p in model.parameters()} == {torch.device("cpu")}
    monkeypatch.undo()
    again = build.build_on_meta(config(*TINY).model)
    build.materialize(again, torch.device("cpu"), seed=3)
    for (name, a), b in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("name, tflops", [("NVIDIA H200", 989), ("NVIDIA H200 NVL", 835),
                                          ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 NVL", 835),
                                          ("NVIDIA H100 PCIe", 756), ("NVIDIA A100-SXM4-80GB", 312)])
def test_peak_flops_by_device_name(name: str, tflops: int) -> None:
    assert peak_flops_of(name) == pytest.approx(tflops * 1e12)
    assert peak_flops_of("Some Other GPU") is None
