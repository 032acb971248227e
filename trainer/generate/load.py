"""What a folder holds, ready to generate: the model (built through its family, weights from a
sharded DCP checkpoint or an export folder), its tokenizer, its bound and its end tokens."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch

from trainer.config import ConfigError
from trainer.data.factory import tokenizer_of_run
from trainer.data.run_tokenizer import load_run_tokenizer
from trainer.models.families import family_of_saved
from trainer.state.checkpoint import STATE, list_checkpoints, verify
from trainer.state.export import load_model_state, model_config

GENERATION_CONFIG = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class GenerateError(Exception):
    """A mistake the user can fix; the message is the one line to print (exit 2)."""


@dataclass
class Loaded:
    logits: Callable[[torch.Tensor], torch.Tensor]  # tokens [1, T] -> logits [1, T, vocab]
    tokenizer: Any  # a transformers tokenizer
    limit: Optional[int]  # the longest sequence the model reads
    device: torch.device
    what: str  # the folder read, for the header line
    eos_ids: set[int] = field(default_factory=set)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise GenerateError(f"--device {name}: no CUDA device here (use --device cpu or auto)")
    return torch.device(name)


def find(path: str) -> tuple[str, str]:
    """("checkpoint", folder) for a committed checkpoint or a run directory's newest one;
    ("export", folder) for a `python -m trainer.export` folder."""
    if not os.path.isdir(path):
        raise GenerateError(f"{path}: no such folder; pass a run directory, a "
                            "checkpoints/step_<N> folder or an export folder")
    if os.path.exists(os.path.join(path, STATE)):
        problem = verify(path)
        if problem:
            raise GenerateError(f"{path}: not a usable checkpoint: {problem}")
        return "checkpoint", path
    if os.path.exists(os.path.join(path, "config.json")):
        return "export", path
    checkpoints = list_checkpoints(os.path.join(path, "checkpoints"))
    for _, candidate in checkpoints:
        if verify(candidate) is None:
            return "checkpoint", candidate
    why = "no committed checkpoint in it yet" if checkpoints else \
        "not a run directory, a checkpoints/step_<N> folder or an export folder"
    raise GenerateError(f"{path}: {why}")


def load(path: str, device: torch.device, tokenizer: Optional[str] = None) -> Loaded:
    kind, folder = find(path)
    if kind == "export":
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        if "model" not in config:  # transformers' own format
            return _load_transformers(folder, device, tokenizer)
        model_cfg, name = config["model"], tokenizer or _own_files(folder)
        tensors = _safetensors(folder)
    else:
        with open(os.path.join(folder, STATE)) as f:
            saved = json.load(f)["config"]
        model_cfg = saved["model"]
        name, tensors = tokenizer, None
    try:
        family = family_of_saved(model_cfg)
    except ConfigError as exc:
        raise GenerateError(f"{folder}: {exc}") from None
    m = model_config(model_cfg)
    model = family.build_on_meta(m)
    try:
        limit = family.context_length(m, model)
    except ConfigError as exc:
        raise GenerateError(f"{folder}: {exc}") from None
    if name is None and kind == "checkpoint":
        name = tokenizer_of_run(saved["data"], family.own_tokenizer(m))
    if name is None:
        raise GenerateError(f"{folder}: the run does not say which tokenizer made its ids "
                            "(data=tokens or synthetic); pass --tokenizer FOLDER")
    if tensors is None:  # a LoRA run's checkpoint: its adapters merged into the base
        from trainer.state.export_lora import merged_tensors

        tensors = merged_tensors(load_model_state(folder), model_cfg)
    _fill(model, tensors, device)
    return Loaded(lambda tokens: model(tokens), _tokenizer(name), limit, device, folder,
                  _eos_ids(folder, m.path))


def _own_files(folder: str) -> Optional[str]:
    return folder if any(os.path.exists(os.path.join(folder, n)) for n in TOKENIZER_FILES) \
        else None


def _safetensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = os.path.join(folder, "model.safetensors")
    if not os.path.exists(path):
        raise GenerateError(f"{folder}: config.json but no model.safetensors; export again")
    return load_file(path)


@torch.no_grad()
def _fill(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor],
          device: torch.device) -> None:
    """Real storage on `device`, the buffers the model computed at construction, and every
    parameter from `tensors` (a tied one through the name it shares)."""
    model.to_empty(device=device)
    if hasattr(model, "reset_buffers"):
        model.reset_buffers()
    missing, unexpected = model.load_state_dict(dict(tensors), strict=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {id(params[name]) for name in tensors if name in params}
    left = [name for name in missing if name in params and id(params[name]) not in loaded]
    if left or unexpected:
        raise GenerateError(f"the checkpoint does not fit the model its config builds: "
                            f"missing {left[:3]}, unexpected {list(unexpected)[:3]}")
    model.eval()


def _load_transformers(folder: str, device: torch.device, tokenizer: Optional[str]) -> Loaded:
    from transformers import AutoModelForCausalLM

    try:
        hf = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise GenerateError(f"{folder}: transformers cannot load it "
                            f"({str(exc).splitlines()[0][:200]})") from None
    hf.to(device).eval()
    name = tokenizer or _own_files(folder)
    if name is None:
        raise GenerateError(f"{folder}: no tokenizer files in it; pass --tokenizer FOLDER")
    return Loaded(lambda tokens: hf(input_ids=tokens, use_cache=False).logits, _tokenizer(name),
                  getattr(hf.config, "max_position_embeddings", None), device, folder,
                  _eos_ids(folder, None))


def _tokenizer(name: str):
    try:
        return load_run_tokenizer(name)
    except Exception as exc:  # transformers raises many kinds for a folder it cannot read
        raise GenerateError(f"cannot load the tokenizer {name} ({str(exc).splitlines()[0][:200]});"
                            " pass --tokenizer FOLDER") from None


def _eos_ids(*folders: Optional[str]) -> set[int]:
    """The end ids a generation_config.json beside the weights (or the pretrained model's)
    names; the tokenizer's own eos is added by the caller."""
    for folder in folders:
        path = os.path.join(folder, GENERATION_CONFIG) if folder else ""
        if path and os.path.exists(path):
            with open(path) as f:
                eos = json.load(f).get("eos_token_id")
            return set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return set()
