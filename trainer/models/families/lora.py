"""LoRA through PEFT on the meta-built model, before the plan's wrappers and fully_shard.

PEFT (`inject_adapter_in_model`, with low_cpu_mem_usage so the adapters are born on meta like
the rest) replaces each targeted nn.Linear by its LoRA layer: the frozen `base_layer` plus
`lora_A` / `lora_B`, and freezes everything else. Because this happens on the meta model, the
blocks FSDP2 shards hold the frozen base and the adapters together (mixed requires_grad inside a
block): one all-gather per block as before, while gradients, reduce-scatters and optimizer state
exist only for the adapters. Values come later, from `materialize`, through `LoraInit`: the base
as the model would initialise (or load) it under its own name, lora_A as PEFT draws it
(Kaiming-uniform, a=sqrt(5)) but from the parameter's own generator, so the adapters are the
same for any world size, and lora_B zero (the adapted model starts as the base).

Where PEFT did not fit: its `get_peft_model` wraps the model in a PeftModel whose forward and
state names are PEFT's; the trainer calls its own wrapper (tokens -> logits, the chunked head),
so only the layer injection is used, and the adapter file is written by trainer/state/
export_lora.py in PEFT's format rather than through save_pretrained (which needs the PeftModel).
"""

from __future__ import annotations

import fnmatch
import math
import os
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from trainer.config import ConfigError
from trainer.config import LoraSettings
from trainer.models.families.qlora import quiet_torchao

ADAPTER = "default"  # PEFT's adapter name; the exported files drop it, as PEFT's do
PEFT_PREFIX = "base_model.model."  # where PeftModel keeps the model it adapts
# A LoRA tensor's name and value as the family's PEFT adapter file holds them
# (Family.adapter_tensor).
ToFile = Callable[[str, torch.Tensor], "tuple[str, torch.Tensor]"]
BASE = ".base_layer"


def base_name(name: str) -> str:
    """A parameter's name in the model without adapters (`...wq.base_layer.weight` -> `...wq.weight`)."""
    return name.replace(BASE + ".", ".")


def seed_name(name: str) -> str:
    """The name whose generator draws a parameter (build.materialize): the base weight's own
    name for an adapted layer's base and for the parts of an NF4-quantized weight, so the base
    is the same with and without adapters or quantization."""
    layer, _, part = name.rpartition(".")
    if part.startswith("nf4_"):
        name = layer + ".weight"
    return base_name(name)


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def block_linears(model: nn.Module, block_names: Sequence[str]) -> list[str]:
    """Names of the nn.Linear modules inside the blocks, in model order."""
    prefixes = tuple(name + "." for name in block_names)
    return [name for name, module in model.named_modules()
            if isinstance(module, nn.Linear) and name.startswith(prefixes)]


def resolve_targets(model: nn.Module, block_names: Sequence[str],
                    patterns: Sequence[str]) -> list[str]:
    """The linear layers model.lora.targets names (globs over module names; empty: every
    linear layer of the blocks). A pattern that matches none is refused, naming the key."""
    candidates = block_linears(model, block_names)
    if not candidates:
        raise ConfigError("model.lora.rank", "the model's blocks have no linear layers to adapt")
    if not patterns:
        return candidates
    every = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in every):
            raise ConfigError("model.lora.targets", f"{pattern!r} matches no linear layer; "
                              f"names look like {', '.join(candidates[:3])}")
    return [name for name in every if any(fnmatch.fnmatchcase(name, p) for p in patterns)]


class LoraInit:
    """The model's init_param with adapters: see the module docstring."""

    def __init__(self, base: Callable[[str, torch.Tensor, torch.Generator], None],
                 nf4: Optional[Callable] = None, start: Optional["AdapterFile"] = None) -> None:
        self.base = base
        self.nf4 = nf4  # qlora.NF4Init, when the base is quantized
        self.start = start  # model.lora.adapter's tensors, when the adapters start from them

    @torch.no_grad()
    def __call__(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        if self.start is not None and is_adapter(name):
            full.copy_(self.start.load(name))
        elif ".lora_A." in name:
            bound = 1.0 / math.sqrt(full.shape[1])  # kaiming_uniform_(a=sqrt(5)), PEFT's default
            full.uniform_(-bound, bound, generator=generator)
        elif ".lora_B." in name:
            full.zero_()
        elif self.nf4 is not None and self.nf4.owns(name):
            self.nf4(name, full, generator, self.base, seed_name(name))
        else:
            self.base(base_name(name), full, generator)


class AdapterFile:
    """model.lora.adapter's lora_A / lora_B for the meta model's adapters, checked on building:
    each under the name the family's export gives it (`to_file`), of the parameter's shape,
    and no tensor left over. A family that reorders rows on export (the built-in Llama's
    rotary rows of lora_B) is undone by sending row numbers through the same function."""

    def __init__(self, folder: str, model: nn.Module, to_file: ToFile) -> None:
        from safetensors import safe_open

        self.path, key = os.path.join(folder, "adapter_model.safetensors"), "model.lora.adapter"
        with safe_open(self.path, "pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        self.where: dict[str, tuple[str, torch.Tensor]] = {}
        for name, param in model.named_parameters():
            if not is_adapter(name):
                continue
            rows = torch.arange(param.shape[0], dtype=torch.float64)[:, None]
            stored, order = to_file(name.replace(f".{ADAPTER}.", "."),
                                    rows.expand(tuple(param.shape)).contiguous())
            stored = PEFT_PREFIX + stored
            if stored not in shapes:
                raise ConfigError("model.lora.targets", f"this run adapts {base_name(name)} "
                                  f"but the adapter at {folder} has no {stored}; set the "
                                  "targets as its adapter_config.json's target_modules")
            if shapes[stored] != tuple(param.shape):
                raise ConfigError(key, f"{folder} adapts another base: {stored} is "
                                  f"{list(shapes[stored])}, this model's {list(param.shape)}")
            self.where[name] = (stored, order[:, 0].long())
        left = sorted(set(shapes) - {stored for stored, _ in self.where.values()})
        if left:
            raise ConfigError("model.lora.targets", f"the adapter at {folder} also holds "
                              f"{len(left)} tensors this run does not adapt (e.g. {left[0]}); "
                              "set the targets as its adapter_config.json's target_modules")

    def load(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        stored, order = self.where[name]
        with safe_open(self.path, "pt") as f:
            tensor = f.get_tensor(stored)
        out = torch.empty_like(tensor)
        out[order] = tensor  # the file's row i is the model's row order[i]
        return out


def apply_lora(model: nn.Module, lora: LoraSettings, block_names: Sequence[str],
               base_init: Callable, to_file: Optional[ToFile] = None) -> list[str]:
    """Adapters on the targeted layers of the meta model, everything else frozen; returns the
    adapted layers' names. `base_init`: how the model initialises a parameter by name;
    `to_file`: its family's adapter_tensor, to start from model.lora.adapter."""
    with quiet_torchao():
        from peft import LoraConfig, inject_adapter_in_model

    targets = resolve_targets(model, block_names, lora.targets)
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=targets, bias="none")
    inject_adapter_in_model(config, model, adapter_name=ADAPTER, low_cpu_mem_usage=True)
    for name, param in model.named_parameters():  # PEFT freezes the rest; say it, not assume it
        param.requires_grad_(is_adapter(name))
    nf4 = None
    if lora.quantize == "nf4":
        from trainer.models.families.qlora import NF4Init, quantize_blocks

        quantize_blocks(model, block_names)
        nf4 = NF4Init(model)
    start = None
    if lora.adapter is not None:
        start = AdapterFile(lora.adapter, model, to_file)
    model.init_param = LoraInit(base_init, nf4, start)
    model.lora_targets = targets
    return targets


def adapter_state(state: dict) -> dict:
    """The adapters of a (full, unsharded) state dict, under the model's own names."""
    return {name: value for name, value in state.items() if is_adapter(name)}


def merged_state(state: dict, lora: LoraSettings) -> dict:
    """The model's state without adapters: each adapted weight W + alpha / rank * B @ A, under
    the names of the model without LoRA (what its family's export writes)."""
    scale = lora.alpha / lora.rank
    out = {}
    for name, value in state.items():
        if is_adapter(name):
            continue
        if BASE + ".weight" in name:
            layer = name[:-len(BASE + ".weight")]
            a = state[f"{layer}.lora_A.{ADAPTER}.weight"].float()
            b = state[f"{layer}.lora_B.{ADAPTER}.weight"].float()
            value = (value.float() + scale * (b @ a)).to(value.dtype)
        out[base_name(name)] = value
    return out


def store_base_in(model: nn.Module, dtype) -> int:
    """The frozen base in `dtype` (sharding.param_dtype): it has no gradient nor optimizer
    state, so it needs no fp32 master copy; FSDP2 all-gathers it as it is stored. On the meta
    model, before fully_shard. Returns how many parameters changed dtype."""
    changed = 0
    for param in model.parameters():
        if not param.requires_grad and param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
            changed += 1
    return changed
