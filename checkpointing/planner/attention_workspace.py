"""Which scaled-dot-product-attention kernel runs on a GPU, and what its backward allocates on top
of its inputs, outputs and gradients (the "workspace" the meta trace cannot see).

The meta trace stands PyTorch's CPU flash kernel in for every fused kernel
(metatrace.FusedAttentionOnMeta): its forward keeps what the CUDA kernels keep (q, k, v, the
output and a [B, H, T] fp32 log-sum-exp) and its backward returns dq, dk, dv. What the CUDA
kernels allocate besides lives only while their backward runs, so it is counted there, as bytes
alive at that op (metatrace.LiveBytes asks `workspace_rule`). Forward workspace is zero for all
three fused kernels at training lengths (below); the math backend keeps T x T probabilities,
which the meta trace's math path counts itself.

The rules, each read from the kernel's own allocation (PyTorch main, 2026; cuDNN frontend 1.x):

flash (FlashAttention-2, aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp,
  `mha_bwd`): `softmax_d` fp32 [B, H, round128(Tq)]; `dq_accum` fp32 [B, round128(Tq), H,
  round(D, 32 if D <= 128 else 64)] (non-deterministic mode; deterministic multiplies it by the
  splits); with fewer KV heads than query heads, `dk_expanded` and `dv_expanded` [B, Tk, H, D]
  in the input dtype, summed into dk/dv after the kernel. Forward: `mha_fwd` allocates split-KV
  accumulators only when `set_params_splitkv` splits, which it does not when B * H * ceil(Tq /
  block) already fills the GPU (every training length here).
cudnn (aten/src/ATen/native/cudnn/MHA.cpp `run_cudnn_SDP_bprop` allocates the graph's
  `get_workspace_size()`; cudnn-frontend include/cudnn_frontend/node/
  scaled_dot_product_flash_attention.h, `CompositeSDPABackwardNode::get_fe_workspace_size_node`):
  `dQ_accum` fp32 [B, H, Tq, D] and `softmax_sum` fp32 [B, H, Tq]; the grouped-query dK/dV
  full-head tensors are virtual for dense (non-ragged) inputs, so they take no workspace. The
  engine's own scratch (a few MiB) is not counted.
efficient (CUTLASS memory-efficient, aten/src/ATen/native/transformers/cuda/
  attention_backward.cu `_efficient_attention_backward`): `delta` fp32 [B, H, Tq]; the kernel's
  workspace holds an fp32 grad-q accumulator [B, H, Tq, D] for 16-bit outputs (its
  kNeedsAccumGradQ); grouped-query inputs reach it with k and v expanded to H heads, so their
  gradients are [B, Tk, H, D] before the sum over each group.

`auto` follows `select_sdp_backend` (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp):
cuDNN first on sm90/sm100 with cuDNN newer than 9.15 (`check_prefer_cudnn_attention`), then
flash, then efficient, then math; each backend's own constraints decide whether it can run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")
FUSED = ("flash", "cudnn", "efficient")

FP32 = 4
_SIXTEEN_BIT = ("bfloat16", "float16")
_ELEMENT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


@dataclass(frozen=True)
class Gpu:
    """What the dispatcher asks of the device: compute capability and the cuDNN runtime
    version (91600 is 9.16.0)."""

    major: int
    minor: int
    cudnn: Optional[int]

    def describe(self) -> str:
        cudnn = "no cuDNN" if self.cudnn is None else f"cuDNN {self.cudnn}"
        return f"sm{self.major}{self.minor}, {cudnn}"


# Where no CUDA device is visible (a report for a GPU cluster run on a laptop): an H100/H200
# (sm90) with the cuDNN of current CUDA wheels, the GPUs this project's long-sequence figures
# are for. Named in the choice's reason, so a report for another GPU says what it assumed.
ASSUMED_GPU = Gpu(9, 0, 91600)


def _round(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def refusal(backend: str, device_type: str, dtype: str, head_dim: int, dropout: float,
            gpu: Optional[Gpu] = None) -> Optional[str]:
    """Why `backend` cannot run attention of this dtype and head size on this device (None when
    it can): the constraints of sdp_utils.cpp (CUDA) and sdp_utils_cpp.cpp (CPU) that a model's
    settings decide. Shapes torch checks per call (sequence lengths, strides) are not here."""
    if backend not in BACKENDS:
        return f"{backend!r} is not one of {', '.join(BACKENDS)}"
    if backend in ("auto", "math"):
        return None
    if device_type != "cuda":
        if backend != "flash":
            return f"{backend} is a CUDA kernel; on {device_type} use flash, math or auto"
        if dropout > 0:  # sdp_utils_cpp.cpp: check_for_dropout
            return "the CPU flash kernel has no attention dropout; use math or auto"
        return None
    gpu = gpu or ASSUMED_GPU
    capability = (gpu.major, gpu.minor)
    if backend == "flash":
        if capability < (8, 0):  # check_flash_attention_hardware_support
            return f"flash needs sm80 or newer, this GPU is {gpu.describe()}"
        if dtype not in _SIXTEEN_BIT:  # check_dtypes_flash_attention
            return f"flash runs bfloat16/float16 only, attention here is {dtype}"
        if head_dim > 256:  # check_head_dim_size_flash
            return f"flash takes head_dim <= 256, got {head_dim}"
        return None
    if backend == "cudnn":
        if gpu.cudnn is None or gpu.cudnn < 90000:
            return f"cudnn attention needs cuDNN 9 or newer ({gpu.describe()})"
        if capability < (8, 0):  # check_cudnn_hardware_support
            return f"cudnn attention needs sm80 or newer, this GPU is {gpu.describe()}"
        if dtype not in _SIXTEEN_BIT:  # check_dtypes_low_precision
            return f"cudnn attention runs bfloat16/float16 only, attention here is {dtype}"
        limit = 256 if gpu.major in (9, 10) and gpu.cudnn > 92200 else 128
        if head_dim > limit or head_dim % 8:  # check_cudnn_tensor_shapes
            return f"cudnn attention takes head_dim <= {limit} and a multiple of 8, got {head_dim}"
        if dropout * 16 != int(dropout * 16):  # check_cudnn_dropout
            return f"cudnn attention takes dropout in steps of 1/16, got {dropout}"
        return None
    # efficient: check_mem_efficient_hardware_support, check_head_dim_size_mem_efficient
    if capability < (5, 0):
        return f"efficient attention needs sm50 or newer, this GPU is {gpu.describe()}"
    if dtype == "bfloat16" and capability < (8, 0):
        return "efficient attention runs bfloat16 on sm80 or newer only"
    alignment = 8 if dtype in _SIXTEEN_BIT else 4
    if head_dim % alignment:
        return f"efficient attention takes head_dim a multiple of {alignment}, got {head_dim}"
    return None


def prefers_cudnn(gpu: Gpu) -> bool:
    """sdp_utils.cpp's check_prefer_cudnn_attention: cuDNN first on sm90/sm100 with a cuDNN
    newer than 9.15.0."""
    return gpu.cudnn is not None and gpu.cudnn > 91500 and gpu.major in (9, 10)


def auto_backend(device_type: str, dtype: str, head_dim: int, dropout: float,
                 gpu: Optional[Gpu] = None) -> str:
    """The backend torch's dispatcher takes for causal attention without a mask."""
    if device_type != "cuda":
        return "flash" if refusal("flash", device_type, dtype, head_dim, dropout) is None \
            else "math"
    gpu = gpu or ASSUMED_GPU
    order = ("cudnn", "flash", "efficient") if prefers_cudnn(gpu) else ("flash", "efficient")
    for backend in order:
        if refusal(backend, device_type, dtype, head_dim, dropout, gpu) is None:
            return backend
    return "math"


def backward_workspace_bytes(backend: str, batch: int, heads: int, kv_heads: int, q_len: int,
                             k_len: int, head_dim: int, dtype: str) -> int:
    """Bytes the backend's backward allocates besides dq, dk and dv (see the module's rules)."""
    element = _ELEMENT_BYTES[dtype]
    grouped = kv_heads != heads
    if backend == "flash":
        q_rounded = _round(q_len, 128)
        d_rounded = _round(head_dim, 32 if head_dim <= 128 else 64)
        softmax_d = batch * heads * q_rounded * FP32
        dq_accum = batch * q_rounded * heads * d_rounded * FP32
        expanded = 2 * batch * k_len * heads * head_dim * element if grouped else 0
        return softmax_d + dq_accum + expanded
    if backend == "cudnn":
        return batch * heads * q_len * head_dim * FP32 + batch * heads * q_len * FP32
    if backend == "efficient":
        delta = batch * heads * q_len * FP32
        accum_q = batch * heads * q_len * head_dim * FP32 if dtype in _SIXTEEN_BIT else 0
        expanded = 2 * batch * k_len * heads * head_dim * element if grouped else 0
        return delta + accum_q + expanded
    return 0


def tile_backend(backend: str, q_len: int, k_len: int) -> str:
    """The kernel of a call: a query tile (fewer queries than keys, checkpointing/
    query_tiles.py) runs torch's bottom-right causal bias, which dispatches to FlashAttention-2
    (the memory-efficient kernel when that is the backend chosen), never cuDNN
    (torch/nn/attention/bias.py, CausalBias._dispatch)."""
    if q_len == k_len:
        return backend
    return "efficient" if backend == "efficient" else "flash"


def workspace_rule(backend: Optional[str]) -> Optional[Callable[[Any, tuple], int]]:
    """For metatrace.LiveBytes: (op, args) -> workspace bytes alive during that op. The CPU
    flash kernel's backward stands for the CUDA kernel's; the memory-efficient kernel's
    backward, which ring attention (sharding/ring_kernels.py) calls itself whatever the
    backend, is its own; every other op adds nothing. None for a CPU run."""
    if backend is None:
        return None
    import torch

    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    efficient_backward = torch.ops.aten._scaled_dot_product_efficient_attention_backward

    def rule(func, args: tuple) -> int:
        packet = getattr(func, "overloadpacket", None)
        if packet is efficient_backward:
            kernel = "efficient"
        elif packet is flash_backward and backend in FUSED:
            kernel = None
        else:
            return 0
        query, key = args[1], args[2]  # (grad_out, query, key, value, ...) for both ops
        batch, heads, q_len, head_dim = query.shape
        dtype = str(query.dtype).removeprefix("torch.")
        kernel = kernel or tile_backend(backend, q_len, key.shape[2])
        return backward_workspace_bytes(kernel, batch, heads, key.shape[1], q_len,
                                        key.shape[2], head_dim, dtype)

    return rule
