"""`python -m trainer.export CHECKPOINT [--out DIR]`: one consolidated safetensors file for inference.

CHECKPOINT is a committed checkpoint folder (`<run dir>/checkpoints/step_<N>`) or a run directory
(its newest committed checkpoint). Writes DIR/model.safetensors (full, unsharded fp32 weights,
named as in the model) and DIR/config.json (the model config and where it came from), or what
the model's family writes instead (trainer/models/families/): a folder `from_pretrained` loads
for the Hugging Face families, one timm loads for timm. A language model's folder also gets the
run's tokenizer (its files and chat template, as `save_pretrained` writes them: data.tokenizer,
model.path's, or the byte tokenizer of data=bytes) and generation_config.json (its bos, eos and
pad ids), so transformers loads it whole. Runs in one process without a process group, whatever
world size wrote the checkpoint; the optimizer state is not read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from dataclasses import fields
from typing import Mapping, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainer.config import ModelConfig
from trainer.data.factory import tokenizer_of_run
from trainer.data.run_tokenizer import load_run_tokenizer
from trainer.models.families import Family, family_of_saved
from trainer.config import LoraSettings
from trainer.state.meta import SafeReader, UnsafeMetadata
from trainer.state.checkpoint import STATE, list_checkpoints, verify


def _pick(path: str) -> str:
    if os.path.exists(os.path.join(path, STATE)):
        problem = verify(path)
        if problem:
            raise SystemExit(f"error: {path} cannot be exported: {problem}")
        return path
    for _, candidate in list_checkpoints(os.path.join(path, "checkpoints")):
        if verify(candidate) is None:
            return candidate
    raise SystemExit(f"error: no committed checkpoint under {path}; pass a run directory or a "
                     "checkpoints/step_<N> folder")


def load_model_state(folder: str) -> dict[str, torch.Tensor]:
    """The model's full tensors from a DCP checkpoint, by parameter name."""
    reader = SafeReader(folder)
    try:
        metadata = reader.read_metadata()
    except UnsafeMetadata as error:
        raise SystemExit(f"error: {error}") from None
    model = {}
    for key, item in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata):
            model[key[len("model."):]] = torch.empty(item.size, dtype=item.properties.dtype)
    state = {"model": model}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state["model"]


def model_config(saved: Mapping) -> ModelConfig:
    """The dataclass of a checkpoint's model section (keys it does not know are dropped)."""
    known = {f.name for f in fields(ModelConfig)}
    values = {k: v for k, v in saved.items() if k in known}
    if isinstance(values.get("lora"), Mapping):
        values["lora"] = LoraSettings(**values["lora"])
    return ModelConfig(**values)


def export(folder: str, out: str, adapter: bool = False) -> str:
    """The checkpoint's model in the form its family exports (trainer/models/families/), with
    the run's tokenizer and generation settings beside a language model's weights. A LoRA
    run's: merged, or with `adapter` its adapters alone (trainer/state/export_lora.py)."""
    from trainer.state.export_lora import export_adapter, export_merged, settings_of

    with open(os.path.join(folder, STATE)) as f:
        saved = json.load(f)
    tensors = {name: t.contiguous() for name, t in load_model_state(folder).items()}
    model_cfg, step = saved["config"]["model"], saved["progress"]["step"]
    family = family_of_saved(model_cfg)
    if adapter:
        out = export_adapter(tensors, model_cfg, out)
    elif settings_of(model_cfg).on:
        out = export_merged(tensors, model_cfg, out, step, folder)
    else:
        out = family.export(tensors, model_cfg, out, step, folder)
    if "data" in saved["config"]:  # older checkpoints and bare test states have none
        write_tokenizer(out, saved["config"]["data"], family, model_config(model_cfg))
    return out


def write_tokenizer(out: str, data: Mapping, family: Family, m: ModelConfig) -> Optional[str]:
    """The run's tokenizer files (chat template included) and generation_config.json in `out`;
    the tokenizer's name, or None where the run does not say which made its ids (or read
    images)."""
    name = tokenizer_of_run(data, family.own_tokenizer(m))
    if name is None:  # an image model's export needs no transformers
        return None
    from transformers import GenerationConfig

    tokenizer = load_run_tokenizer(name)
    tokenizer.save_pretrained(out)
    pretrained = m.path and os.path.exists(os.path.join(m.path, "generation_config.json"))
    generation = GenerationConfig.from_pretrained(m.path) if pretrained else GenerationConfig()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, key)
        if value is not None:
            setattr(generation, key, value)
    if generation.pad_token_id is None:  # transformers pads finished rows with it
        generation.pad_token_id = generation.eos_token_id
    generation.save_pretrained(out)
    return name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="checkpoints/step_<N> folder, or a run directory")
    parser.add_argument("--out", help="output folder (default: <checkpoint>/../../export/step_<N>)")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--adapter", action="store_true", help="a LoRA run's adapters alone, in "
                      "PEFT's format (PeftModel.from_pretrained on the base folder)")
    kind.add_argument("--merged", action="store_true", help="a LoRA run's adapters merged into "
                      "the base: a whole model folder (the default for a LoRA checkpoint)")
    args = parser.parse_args(argv)
    folder = _pick(args.checkpoint)
    out = args.out or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(folder))),
                                   "export", os.path.basename(folder))
    export(folder, out, adapter=args.adapter)
    print(f"exported {folder} to {out}: {', '.join(sorted(os.listdir(out)))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
