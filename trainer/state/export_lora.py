"""Exports of a LoRA run (`python -m trainer.export CHECKPOINT --adapter | --merged`).

--adapter: the adapters alone in PEFT's format, adapter_config.json + adapter_model.safetensors,
which `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(<base>), <folder>)` loads
on the base folder (model.path; the built-in Llama/Qwen3 under transformers' names, as their
own export writes them). --merged (the default for a LoRA checkpoint): every adapted weight
W + alpha / rank * B @ A, written by the model's family like a run without adapters, so
`AutoModelForCausalLM.from_pretrained` (and trainer.generate) load it.
"""

from __future__ import annotations

import os
from typing import Mapping

import torch

from trainer.models.families import family_of_saved
from trainer.models.families.lora import ADAPTER, PEFT_PREFIX, merged_state
from trainer.config import LoraSettings

QUANTIZED = ".nf4_"  # the names of an NF4 base weight's parts (trainer/models/families/qlora.py)


def settings_of(model: Mapping) -> LoraSettings:
    """The checkpoint's model.lora (off where it has none)."""
    return LoraSettings(**(model.get("lora") or {}))


def without_lora(model: Mapping) -> dict:
    return {k: v for k, v in model.items() if k != "lora"}


def dequantized(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """NF4-quantized base weights (model.lora.quantize) back to dense ones, by their name."""
    if not any(QUANTIZED in name for name in tensors):
        return dict(tensors)
    from trainer.models.families.qlora import dense_weights

    return dense_weights(dict(tensors))


def merged_tensors(tensors: Mapping[str, torch.Tensor], model: Mapping) -> dict:
    """A LoRA checkpoint's tensors as the model without adapters holds them (merged, and
    dequantized where the base was NF4); others' as they are."""
    lora = settings_of(model)
    return merged_state(dequantized(tensors), lora) if lora.on else dict(tensors)


def export_merged(tensors: Mapping[str, torch.Tensor], model: Mapping, out: str, step: int,
                  checkpoint: str) -> str:
    state = merged_tensors(tensors, model)
    return family_of_saved(model).export(state, without_lora(model), out, step, checkpoint)


def export_adapter(tensors: Mapping[str, torch.Tensor], model: Mapping, out: str) -> str:
    from peft import LoraConfig
    from safetensors.torch import save_file

    lora = settings_of(model)
    if not lora.on:
        raise SystemExit("error: --adapter: this checkpoint trained no adapters (model.lora.rank "
                         "was null); export it without --adapter")
    family = family_of_saved(model)
    state, targets = {}, []
    for name, tensor in tensors.items():
        for part in ("lora_A", "lora_B"):
            marker = f".{part}.{ADAPTER}.weight"
            if name.endswith(marker):  # PEFT's file drops the adapter's name
                hf_name, value = family.adapter_tensor(
                    f"{name[:-len(marker)]}.{part}.weight", tensor, model)
                state[PEFT_PREFIX + hf_name] = value.contiguous()
                if part == "lora_A":
                    targets.append(hf_name.removesuffix(".lora_A.weight"))
    os.makedirs(out, exist_ok=True)
    save_file(state, os.path.join(out, "adapter_model.safetensors"), metadata={"format": "pt"})
    LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
               target_modules=sorted(targets), task_type="CAUSAL_LM", bias="none",
               base_model_name_or_path=model.get("path")).save_pretrained(out)
    return out
