"""`model.attention`: which scaled-dot-product-attention kernel the run uses, checked before any
process starts, carried out around every attention call, and told to the planner.

`auto` leaves the choice to torch's dispatcher and predicts it (the rules and their sources are in
checkpointing/planner/attention_workspace.py), so the memory plan counts that kernel's workspace;
`flash`, `cudnn`, `efficient` and `math` restrict every unmasked attention call to that kernel
with torch.nn.attention.sdpa_kernel, so the run is what was planned or stops with torch's reason.
Masked calls (packed documents' SDPA mask) keep torch's own choice: flash and cuDNN take no
boolean mask, and the plan measures those calls on their original path.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Optional

from checkpointing.planner.attention_workspace import (ASSUMED_GPU, Gpu, auto_backend,
                                                       prefers_cudnn, refusal)
from trainer.config import Config, ConfigError, ModelConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

log = logging.getLogger(__name__)

_MASK_OPTIONS = ("mask", "attn_mask", "attention_mask")


def compute_dtype(cfg: Config) -> str:
    """The dtype attention computes in: FSDP's param_dtype where sharding casts, else the
    model's own float32."""
    s = cfg.sharding
    return s.param_dtype if s.mode != "none" and s.param_dtype else "float32"


def head_dim_of(m: ModelConfig) -> Optional[int]:
    """One attention head's width from the settings, where they say it (None: unknown here)."""
    if m.arch in ("llama", "qwen3", "vit"):
        return m.head_dim or m.dim // m.n_heads
    fields = dict(m.hf_config or {}) if m.arch in ("hf", "hf_vision") else {}
    if fields.get("head_dim"):
        return int(fields["head_dim"])
    if fields.get("hidden_size") and fields.get("num_attention_heads"):
        return int(fields["hidden_size"]) // int(fields["num_attention_heads"])
    return None


def visible_gpu() -> Optional[Gpu]:
    """The visible CUDA device's facts, or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return Gpu(major, minor, torch.backends.cudnn.version())


def run_device_type(cfg: Config) -> str:
    """Where training runs: train.device, auto meaning CUDA when this host has it."""
    if cfg.train.device != "auto":
        return cfg.train.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_attention(cfg: Config) -> None:
    """model.attention a backend this run's device and dtype can run (trainer/validate.py)."""
    backend = cfg.model.attention
    if backend in ("auto", "math"):
        return  # always runnable: torch's own choice, or the reference maths
    device = run_device_type(cfg)
    why = refusal(backend, device, compute_dtype(cfg), head_dim_of(cfg.model) or 8,
                  cfg.model.dropout, visible_gpu() if device == "cuda" else None)
    if why is not None:
        where = (" (train.device=auto runs on the CPU here; set train.device=cuda to plan for a "
                 "GPU)" if device == "cpu" and cfg.train.device == "auto" else "")
        raise ConfigError("model.attention", f"{backend}: {why}{where}")


def resolve(cfg: Config, device_type: str, gpu: Optional[Gpu] = None) -> tuple[str, str]:
    """(backend, why) for a run on `device_type` (the planner's: cpu or cuda); `gpu` defaults to
    the visible device, else the assumed one (attention_workspace.ASSUMED_GPU)."""
    m = cfg.model
    dtype, head_dim = compute_dtype(cfg), head_dim_of(m) or 8
    if device_type == "cuda" and gpu is None:
        gpu = visible_gpu()
        assumed = gpu is None
        gpu = gpu or ASSUMED_GPU
    else:
        assumed = False
    if m.attention != "auto":
        return m.attention, "model.attention"
    chosen = auto_backend(device_type, dtype, head_dim, m.dropout, gpu)
    if device_type != "cuda":
        return chosen, f"auto: {device_type}, {dtype}"
    facts = f"{gpu.describe()}{' assumed: no CUDA device here' if assumed else ''}"
    first = "cuDNN first" if prefers_cudnn(gpu) else "flash first"
    return chosen, f"auto: {facts}, {dtype}, head_dim {head_dim}, {first}"


def kernel_wrap(backend: str) -> Callable:
    """A wrap for a family's `wrap_attention`: unmasked calls run under sdpa_kernel(backend)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[backend]

    def wrap(attend: Callable) -> Callable:
        def attend_with(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options):
            if any(options.get(name) is not None for name in _MASK_OPTIONS):
                return attend(q, k, v, **options)
            with sdpa_kernel(chosen):
                return attend(q, k, v, **options)
        attend_with.exchanges_tokens = getattr(attend, "exchanges_tokens", False)
        return attend_with

    return wrap


def apply_attention(cfg: Config, model: nn.Module, device: torch.device, say: bool) -> str:
    """Carry out model.attention on the built model (before Ulysses wraps its attention, so
    the kernel choice is the innermost wrap); logs the backend once when `say`."""
    from trainer.models.families import family_of

    backend, why = resolve(cfg, device.type)
    if cfg.model.attention != "auto":
        family_of(cfg.model).wrap_attention(model, kernel_wrap(backend))
    if say:
        log.info("attention: %s (%s)", backend, why)
    return backend
