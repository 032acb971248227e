"""QLoRA (model.lora.quantize=nf4): the frozen base's block linears stored as 4-bit NF4.

torchao's NF4Tensor does the quantization (to_nf4: 64-element blocks of 4-bit codes, their
absmax scalers quantized again to int8 in blocks) and the layer's maths (linear_nf4: the weight
dequantized for the forward and again in the backward, so no dequantized copy is kept between
them). Why torchao over bitsandbytes: it runs on CPU and CUDA alike (bitsandbytes' 4-bit
kernels are CUDA-first, and its Params4bit is not a tensor fully_shard takes per block), and
its parts are plain tensors.

Those parts are what FSDP2 sees: each NF4 layer holds them as frozen parameters (nf4_data:
uint8 codes, two per byte; nf4_scalers: int8; nf4_factor, nf4_mean, nf4_table: the base's
float dtype; nf4_shape: the weight's shape), so fully_shard shards them like any parameter, the
block's all-gather brings them whole inside the plan's unit, and the layer rebuilds its
NF4Tensor there and dequantizes one weight at a time. The memory model counts the 4-bit storage
(its parameters' own dtypes) and the largest dequantized weight of a block
(`dequantized_numel`, checkpointing/planner/param_bytes.py).
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Iterator, Optional, Sequence

import torch
from torch import nn

from trainer.config import ConfigError

BLOCK = 64  # elements per absmax block (QLoRA's and torchao's default)
SCALER_BLOCKS = (256, 128, 64, 32, 16, 8, 4, 2, 1)  # scaler blocks tried, largest first
PARTS = ("nf4_data", "nf4_scalers", "nf4_factor", "nf4_mean", "nf4_table", "nf4_shape")


@contextlib.contextmanager
def quiet_torchao() -> Iterator[None]:
    """PEFT imports torchao where it is installed (QLoRA's), whose import warns of CUDA
    extensions it cannot load on a CPU host, of Triton, and of torch's pytree: a dozen lines per
    rank that say nothing about the run. Errors still show."""
    names = ("torchao", "torch.utils._pytree", "torchao.kernel.intmm")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _nf4():
    try:
        with quiet_torchao():
            from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError:
        raise ConfigError("model.lora.quantize", "nf4 needs torchao (pip install "
                          "'blocktrain[qlora]'), or set model.lora.quantize=none") from None
    return nf4_tensor


def scaler_block(numel: int) -> int:
    """The largest scaler block dividing the weight's absmax count (torchao needs one)."""
    blocks = numel // BLOCK
    return next(s for s in SCALER_BLOCKS if blocks % s == 0)


def check_quantizable(name: str, shape: Sequence[int]) -> None:
    numel = math.prod(shape)
    if numel % BLOCK:
        raise ConfigError("model.lora.quantize", f"nf4 quantizes in blocks of {BLOCK} elements; "
                          f"{name} has {numel} ({'x'.join(map(str, shape))}); set "
                          "model.lora.quantize=none")


class NF4Linear(nn.Module):
    """A frozen linear layer without bias whose weight is stored in NF4 (see the module)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        numel = in_features * out_features
        self.dequantized_numel = numel
        self.scaler_block_size = scaler_block(numel)
        sizes = {"nf4_data": (numel // 2, torch.uint8), "nf4_scalers": (numel // BLOCK, torch.int8),
                 "nf4_factor": (numel // BLOCK // self.scaler_block_size, dtype),
                 "nf4_mean": (1, dtype), "nf4_table": (16, dtype), "nf4_shape": (2, torch.int64)}
        for part, (size, kind) in sizes.items():
            self.register_parameter(part, nn.Parameter(
                torch.empty(size, dtype=kind, device="meta"), requires_grad=False))

    def weight_nf4(self):
        nf4 = _nf4()
        shape = torch.Size((self.out_features, self.in_features))
        meta = nf4.SubclassTensorArgs(shape, (self.in_features, 1), 0, self.nf4_table.dtype,
                                      self.nf4_data.device, False)
        return nf4.NF4Tensor(meta, BLOCK, self.dequantized_numel // BLOCK,
                             self.scaler_block_size, self.nf4_scalers, self.nf4_factor,
                             self.nf4_mean.reshape(()), self.nf4_data, self.nf4_table)

    def meta_linear_flops(self, x: torch.Tensor) -> int:
        """The matmul its meta forward leaves out (checkpointing/planner/linear_flops.py)."""
        from checkpointing.planner.linear_flops import matmul_flops

        return matmul_flops(x, self.in_features, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "meta":  # the memory model's trace: shapes only
            return x.new_empty((*x.shape[:-1], self.out_features))
        weight = self.weight_nf4()
        return _nf4().linear_nf4(x.to(weight.dtype), weight)


def quantize_blocks(model: nn.Module, block_names: Sequence[str]) -> list[str]:
    """Every linear layer of the blocks (a LoRA layer's base) as an NF4Linear, on meta; the
    adapters stay as they are. Returns the quantized layers' names (as the model names them)."""
    _nf4()
    prefixes = tuple(n + "." for n in block_names)
    done = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or not name.startswith(prefixes) \
                or ".lora_" in name:
            continue
        if module.bias is not None:
            raise ConfigError("model.lora.quantize", f"{name} has a bias, which nf4 layers "
                              "here do not keep; set model.lora.quantize=none")
        check_quantizable(name, tuple(module.weight.shape))
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, NF4Linear(module.in_features, module.out_features,
                                         module.weight.dtype))
        done.append(name)
    return done


class NF4Init:
    """Fills an NF4 layer's parts from its full weight as the model draws or loads it (the
    weight's own name and generator), quantized once per layer."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, NF4Linear)}
        self._last: Optional[tuple[str, object]] = None

    def owns(self, name: str) -> bool:
        return name.rpartition(".")[0] in self.layers and name.rpartition(".")[2] in PARTS

    @torch.no_grad()
    def __call__(self, name: str, full: torch.Tensor, generator: torch.Generator,
                 base_init, weight_name: str) -> None:
        layer, _, part = name.rpartition(".")
        module = self.layers[layer]
        if part == "nf4_shape":
            full.copy_(torch.tensor([module.out_features, module.in_features]))
            return
        if self._last is None or self._last[0] != layer:
            weight = torch.empty((module.out_features, module.in_features),
                                 dtype=module.nf4_table.dtype, device=full.device)
            base_init(weight_name, weight, generator)
            self._last = (layer, _nf4().to_nf4(weight, BLOCK, module.scaler_block_size))
        quantized = self._last[1]
        value = {"nf4_data": quantized.quantized_data, "nf4_scalers": quantized.quantized_scalers,
                 "nf4_factor": quantized.quantization_factor,
                 "nf4_mean": quantized.scaler_mean.reshape(1),
                 "nf4_table": quantized.nf4}[part]
        full.copy_(value.reshape(full.shape))


def dense_weights(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with each NF4 layer's parts replaced by its dequantized `<layer>.weight`."""
    nf4 = _nf4()
    out, layers = {}, {}
    for name, tensor in tensors.items():
        layer, _, part = name.rpartition(".")
        if part in PARTS:
            layers.setdefault(layer, {})[part] = tensor
        else:
            out[name] = tensor
    for layer, parts in layers.items():
        rows, cols = (int(v) for v in parts["nf4_shape"])
        meta = nf4.SubclassTensorArgs(torch.Size((rows, cols)), (cols, 1), 0,
                                      parts["nf4_table"].dtype, torch.device("cpu"), False)
        weight = nf4.NF4Tensor(meta, BLOCK, rows * cols // BLOCK,
                               scaler_block(rows * cols), parts["nf4_scalers"],
                               parts["nf4_factor"], parts["nf4_mean"].reshape(()),
                               parts["nf4_data"], parts["nf4_table"])
        out[f"{layer}.weight"] = weight.get_original_weight()
    return out
