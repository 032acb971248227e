"""timm image classifiers as blocktrain models (`model.arch=timm`).

`model.name` is a timm model name (`vit_base_patch16_224`, `deit_small_patch16_224`,
`eva02_tiny_patch14_224`, ...) or `local-dir:<folder>` (a folder timm's `save_for_hf` wrote, as
`python -m trainer.export` does); `model.timm_args` are more keyword arguments for
`timm.create_model` (e.g. `{embed_dim: 64, depth: 4}` to build one small). Pretrained weights
come from `model.checkpoint_path` (a local .safetensors / .pth / .bin file) or the local-dir
folder; nothing is downloaded.

Loading goes through timm itself: `create_model(pretrained=True)` on a meta model runs the
model's own checkpoint filter (position embeddings resampled to `model.image_size`, old layouts
converted, input channels adapted), and the state dict it would load is taken instead of being
copied into meta tensors. Each parameter is then filled from it when `materialize` reaches it,
so the model is never allocated whole before the plan and sharding apply. A head whose shape
differs (another `model.num_classes`) starts from scratch.

The wrapper makes the trainer's contract: `model(images) -> logits`; `init_param(name, full,
generator)`; `reset_buffers()`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from typing import Any, Iterator, Mapping, Optional

import torch
from torch import nn

from trainer.models.hf import HFModelError, _parameters_on_meta
from trainer.models.weights import BufferKeeper

log = logging.getLogger("trainer")
PREFIX = "timm."
LOCAL_DIR = "local-dir:"
# timm's interpolation names -> Pillow's resample codes (what trainer/data/images.py resizes with).
RESAMPLE = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5}
INSTALL = "model.arch: timm needs the timm package: pip install 'blocktrain[timm]'"


class TimmModelError(HFModelError):
    """A timm model that cannot be built from what the user gave; names the key to change."""


def _timm():
    try:
        import timm
    except ImportError as exc:
        raise TimmModelError(f"{INSTALL} ({exc})") from None
    except RuntimeError as exc:  # a torchvision built for another torch fails at import
        raise TimmModelError(f"{INSTALL}; importing it failed: {exc} (timm needs a torchvision "
                             "built for this torch)") from None
    return timm


def local_dir(name: str) -> Optional[str]:
    return name[len(LOCAL_DIR):] if name.startswith(LOCAL_DIR) else None


def architecture(name: str) -> str:
    """The timm architecture `model.name` builds (a local-dir folder's config.json says)."""
    folder = local_dir(name)
    if folder is None:
        return name
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise TimmModelError(f"model.name: {folder} has no config.json (a folder timm's "
                             "save_for_hf or python -m trainer.export wrote)")
    with open(path) as f:
        return json.load(f)["architecture"]


def create_kwargs(image_size: int, num_classes: int, channels: int, dropout: Optional[float],
                  timm_args: Optional[Mapping]) -> dict:
    kwargs: dict[str, Any] = {"img_size": image_size, "num_classes": num_classes,
                              "in_chans": channels}
    # ViT-family names; timm_args may set them one by one (attn_drop_rate too, which takes SDPA
    # off its fused kernels onto the path that keeps each T x T matrix: not set from here).
    if dropout is not None:
        kwargs.update(drop_rate=dropout, proj_drop_rate=dropout)
    kwargs.update(dict(timm_args or {}))
    return kwargs


def _create(name: str, kwargs: Mapping, **more):
    timm = _timm()
    if local_dir(name) is None and not timm.is_model(name.split(".")[0]):
        import difflib

        like = difflib.get_close_matches(name, timm.list_models(), n=4, cutoff=0.6)
        raise TimmModelError(f"model.name: {name!r} is not a timm model"
                             + (f"; close names: {', '.join(like)}" if like else ""))
    try:
        return timm.create_model(name, **kwargs, **more)
    except TypeError as exc:  # an argument this architecture does not take
        raise TimmModelError(f"model.timm_args: {exc}") from None


@contextlib.contextmanager
def _taking_loaded_state(into: dict) -> Iterator[None]:
    """nn.Module.load_state_dict records the state dict instead of copying it (into meta
    tensors, where it would be lost); timm's loader calls it once, on the model."""
    from torch.nn.modules.module import _IncompatibleKeys

    load = nn.Module.load_state_dict

    def take(module: nn.Module, state_dict: Mapping, strict: bool = True, assign: bool = False):
        into.clear()
        into.update(state_dict)
        return _IncompatibleKeys([], [])

    nn.Module.load_state_dict = take
    try:
        yield
    finally:
        nn.Module.load_state_dict = load


def pretrained_state(name: str, kwargs: Mapping, checkpoint_path: Optional[str]) -> dict:
    """The state dict timm would load into this model: the checkpoint after the model's own
    filter (positions resampled to this image size, input channels adapted)."""
    # classifier=None: the head is compared by shape here, not by the registry's class count.
    overlay: dict[str, Any] = {"classifier": None, "custom_load": False}
    if checkpoint_path is not None:
        if checkpoint_path.endswith(".npz"):
            raise TimmModelError("model.checkpoint_path: .npz (JAX) checkpoints load through "
                                 "timm's custom loader into a real model; save it as "
                                 ".safetensors with timm first")
        overlay["file"] = checkpoint_path
    state: dict = {}
    with _parameters_on_meta(), _taking_loaded_state(state):
        _create(name, kwargs, pretrained=True, pretrained_cfg_overlay=overlay)
    return state


class TimmClassifier(BufferKeeper):
    def __init__(self, model: nn.Module, name: str, kwargs: Mapping,
                 checkpoint_path: Optional[str]) -> None:
        super().__init__()
        self.timm = model
        self.keep_buffers()
        self._name, self._kwargs, self._checkpoint = name, dict(kwargs), checkpoint_path
        self._pretrained = checkpoint_path is not None or local_dir(name) is not None
        self._state: Optional[dict] = None  # read at the first init_param, emptied as used

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.timm(images)

    def flops_per_token(self, tokens: int) -> float:
        """6 N + 12 L d T over the patch tokens, N the parameters outside the patch embedding."""
        m = self.timm
        embed = sum(p.numel() for p in m.patch_embed.parameters())
        n = sum(p.numel() for p in self.parameters()) - embed
        return float(6 * n + 12 * len(m.blocks) * m.embed_dim * (tokens + 1))

    def _head(self, timm_name: str) -> bool:
        head = self.timm.get_classifier()
        return any(p is self.timm.get_parameter(timm_name) for p in head.parameters())

    @torch.no_grad()
    def init_param(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        timm_name = name[len(PREFIX):] if name.startswith(PREFIX) else name
        if self._pretrained:
            if self._state is None:
                self._state = pretrained_state(self._name, self._kwargs, self._checkpoint)
            saved = self._state.pop(timm_name, None)  # released as used: one copy at most
            if saved is not None and saved.shape == full.shape:
                full.copy_(saved.to(full.dtype))
                return
            if not self._head(timm_name):
                raise TimmModelError(
                    f"model.checkpoint_path: {timm_name} is "
                    f"{'missing' if saved is None else tuple(saved.shape)} in the checkpoint, "
                    f"{tuple(full.shape)} in model.name={self._name}")
            log.info(f"model.checkpoint_path: the pretrained head {timm_name} is "
                     f"{'absent' if saved is None else tuple(saved.shape)}, model.num_classes "
                     f"needs {tuple(full.shape)}: it starts from scratch")
        if full.ndim >= 2 or timm_name.endswith(("cls_token", "reg_token", "dist_token",
                                                 "pos_embed")):
            nn.init.trunc_normal_(full, mean=0.0, std=0.02, generator=generator)
        elif timm_name.endswith("bias"):
            full.zero_()
        else:  # norm scales, layer scales
            full.fill_(1.0)


def build_timm_on_meta(name: str, checkpoint_path: Optional[str], image_size: int,
                       num_classes: int, channels: int, dropout: Optional[float] = None,
                       timm_args: Optional[Mapping] = None) -> TimmClassifier:
    """The wrapped classifier with parameters on meta; pretrained weights are read when
    `materialize` initialises them."""
    kwargs = create_kwargs(image_size, num_classes, channels, dropout, timm_args)
    with _parameters_on_meta():
        model = _create(name, kwargs, pretrained=False)
    return TimmClassifier(model, name, kwargs, checkpoint_path)


def model_patch_size(model: nn.Module) -> Optional[int]:
    patch = getattr(getattr(model, "patch_embed", None), "patch_size", None)
    return None if patch is None else int(patch[0] if isinstance(patch, (tuple, list)) else patch)


def preprocessing(name: str, timm_args: Optional[Mapping] = None) -> Optional[dict]:
    """The model's own image preprocessing (mean, std, interpolation) from its pretrained
    config (the registry's, or a local-dir folder's config.json)."""
    with _parameters_on_meta():
        model = _create(name, dict(timm_args or {}), pretrained=False)
    cfg = getattr(model, "pretrained_cfg", None) or {}
    out = {}
    if "mean" in cfg and "std" in cfg:
        out.update(image_mean=list(cfg["mean"]), image_std=list(cfg["std"]))
    if cfg.get("interpolation") in RESAMPLE:
        out["resample"] = RESAMPLE[cfg["interpolation"]]
    return out or None


def save_for_timm(tensors: Mapping[str, torch.Tensor], model_cfg: Mapping, out: str) -> str:
    """A folder timm loads back: `timm.create_model("local-dir:<out>", pretrained=True)` (and
    `model.name=local-dir:<out>` here), at the resolution and classes the run tuned."""
    from timm.models import save_for_hf

    kwargs = create_kwargs(model_cfg["image_size"], model_cfg["num_classes"],
                           model_cfg["channels"], None, model_cfg.get("timm_args"))
    model = _create(model_cfg["name"], kwargs, pretrained=False)
    model.load_state_dict({k[len(PREFIX):] if k.startswith(PREFIX) else k: v
                           for k, v in tensors.items()})
    save_for_hf(model, out, model_args=kwargs, safe_serialization=True)
    return out


def check_timm(m) -> None:
    """model.arch=timm settings (m: the ModelConfig), checked before any process group: timm
    importable, the model known (or the local-dir folder there), timm_args accepted, the patch
    size the model's."""
    from trainer.config import ConfigError, require

    require(m.path is None and m.hf_config is None, "model.path",
            "model.arch=timm takes model.name=<timm model> and model.checkpoint_path=<file>, "
            "not model.path or model.hf_config")
    if m.checkpoint_path is not None:
        require(os.path.isfile(m.checkpoint_path), "model.checkpoint_path",
                f"no such file: {m.checkpoint_path} (a local .safetensors or .pth file)")
    require(m.timm_args is None or isinstance(m.timm_args, Mapping), "model.timm_args",
            "must be a mapping of timm.create_model arguments, e.g. {embed_dim: 64, depth: 4}")
    try:
        architecture(m.name)
        built = build_timm_on_meta(m.name, None, m.image_size, m.num_classes, m.channels,
                                   m.dropout, m.timm_args)
    except TimmModelError as exc:
        key, _, message = str(exc).partition(": ")
        raise ConfigError(key, message) from None
    patch = model_patch_size(built.timm)
    require(patch is None or patch == m.patch_size, "model.patch_size",
            f"must be the model's own patch size {patch}, got {m.patch_size}")
