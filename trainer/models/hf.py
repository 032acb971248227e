"""Hugging Face causal LMs as blocktrain models (`model.arch=hf`).

The model is built from a config (`model.hf_config`: a model type and its fields, random init)
or from a local pretrained directory (`model.path`: config.json + *.safetensors), never over the
network. Parameters are created on the meta device, so nothing is allocated before the plan and
sharding are applied; buffers (rotary tables) are computed for real at construction and restored
after materialisation. Pretrained weights are read one tensor at a time from the safetensors
files (memory-mapped) and each rank keeps only its shard: no rank ever holds the full model.

The wrapper makes the trainer's contract: `model(tokens, positions=None) -> logits`;
`init_param(name, full, generator)` fills one parameter (random, or from the checkpoint);
`reset_buffers()`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from torch import nn

from trainer.models.hf_settings import bent_logit_fields
from trainer.models.weights import BufferKeeper, SafetensorsReader

PREFIX = "hf."  # parameter names inside the wrapper; the HF name follows
# Names registered in transformers' attention registries, "blocktrain+<the model's own>": every
# attention module of a model whose attention was wrapped calls its own `attend` through them.
ATTENTION = "blocktrain+"


class HFModelError(ValueError):
    """A model that cannot be built from what the user gave; names the key to change."""


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Parameters go to the meta device as they are registered; buffers stay real (they are
    small, computed at construction, and not restorable from a checkpoint)."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _hf_config(hf_config: Any, path: Optional[str]):
    from transformers import AutoConfig

    if path:
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise HFModelError(f"model.path: {path} has no config.json (a local folder saved "
                               "with save_pretrained; nothing is downloaded)")
        return AutoConfig.from_pretrained(path, local_files_only=True)
    if not isinstance(hf_config, Mapping) or "model_type" not in hf_config:
        raise HFModelError("model.hf_config: give a mapping with model_type and its fields, "
                           "e.g. {model_type: llama, hidden_size: 256, ...}, or set model.path")
    fields = dict(hf_config)
    model_type = fields.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **fields)
    except ValueError as exc:
        raise HFModelError(f"model.hf_config.model_type: {model_type!r} is not an architecture "
                           f"this transformers knows ({exc.__class__.__name__})") from exc


@contextlib.contextmanager
def _masks_as_in_training() -> Iterator[None]:
    """HF looks at position values to detect packed sequences; under fake tensors it cannot,
    assumes packing, builds an explicit mask, and SDPA would be traced on its masked path
    (keeping a T x T matrix). A training batch (one sequence per row) has no packing and takes
    the causal kernel; say so while tracing. Left alone where transformers lacks the function."""
    import transformers.masking_utils as masking

    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is not None:
        masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        if original is not None:
            masking.find_packed_sequence_indices = original


class HFWrapper(BufferKeeper):
    """What every HF wrapper shares: the model under `hf.`, its init scale, the pretrained
    reader, and real buffer values (e.g. rotary inv_freq) restored after to_empty()."""

    def __init__(self, hf_model: nn.Module, checkpoint: Optional[str] = None) -> None:
        super().__init__()
        self.hf = hf_model
        self.keep_buffers()
        self._std = float(getattr(hf_model.config, "initializer_range", 0.02))
        self._reader = SafetensorsReader(checkpoint) if checkpoint else None


class HFCausalLM(HFWrapper):
    # Sequence parallel (families/hf.py's sequence_parallel): the ranks sharing each sample and
    # the attention implementation the wrapped one stands for ("sdpa" or "eager").
    sequence_group = None
    context_group = None  # the ring (sharding.context); None: none
    sequence_implementation = "sdpa"

    def forward(self, tokens: torch.Tensor, positions: Optional[torch.Tensor] = None,
                targets: Optional[torch.Tensor] = None, chunk_tokens: Optional[int] = None,
                rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits [B, T, vocab]. `positions` ([B, T] integers, restarting at 0 per document)
        makes a packed batch: HF reads documents from `position_ids` when no attention mask is
        given (masking_utils.find_packed_sequence_indices) and keeps attention inside each.

        With `targets` and `chunk_tokens` (checkpointing.head=chunked): the summed next-token
        loss from the decoder's last hidden state and the output projection's weight through
        the fused chunked head; HF's own logits and loss are never made. With `targets` and
        `rows` (flat positions into [B * T], checkpointing.head_rows=supervised): the summed
        loss of the head, plain or chunked, on those rows only."""
        # Without positions the call is exactly the unpacked one (HF makes its own arange).
        extra = {} if positions is None else {"position_ids": positions}
        if self.sequence_group is not None or self.context_group is not None:
            extra = self._sequence_parallel(tokens, positions)
        if targets is not None and (chunk_tokens is not None or rows is not None):
            if chunk_tokens is None and bent_logit_fields(self.hf.config):
                # HF bends its logits after the output layer (soft-capping, scales): the rows
                # of its own logits, exact but with no saving.
                from checkpointing.head import summed_head_loss

                logits = self(tokens, positions=positions)
                return summed_head_loss(nn.Identity(), nn.Identity(), logits, targets, None, rows)
            return self._head_loss(tokens, extra, targets, chunk_tokens, rows)
        if tokens.device.type == "meta":
            # HF decides mask shortcuts from tensor values, which meta tensors do not have;
            # fake tensors it recognises as tracing (shapes only, like meta). Packed or not,
            # the trace takes the causal path: shapes only, no document mask.
            from torch._subclasses.fake_tensor import FakeTensorMode

            with FakeTensorMode(allow_non_fake_inputs=True), _masks_as_in_training():
                return self.hf(input_ids=tokens, use_cache=False, **extra).logits
        return self.hf(input_ids=tokens, use_cache=False, **extra).logits

    def _sequence_parallel(self, tokens: torch.Tensor,
                           positions: Optional[torch.Tensor]) -> dict:
        """HF's keyword arguments for this rank's slice: the global positions of its tokens
        (rotary angles of the whole sequence) and the whole sequence's mask, which the wrapped
        attention takes instead of HF's slice-sized one (trainer/models/sequence_parallel.py).
        `positions`: the slice of the packed positions, or None (unpacked rows)."""
        from trainer.models.sequence_parallel import (SEQUENCE_MASK, global_positions,
                                                      group_place, hf_ring_kwargs,
                                                      hf_whole_mask)

        if self.context_group is not None:
            return hf_ring_kwargs(tokens, positions, self.sequence_group, self.context_group)
        _, degree = group_place(self.sequence_group)
        dtype = self.hf.get_input_embeddings().weight.dtype
        mask = hf_whole_mask(positions, self.sequence_group, tokens.shape[1] * degree,
                             self.sequence_implementation, dtype, tokens.device)
        local = global_positions(tokens, self.sequence_group) if positions is None else positions
        return {"position_ids": local, SEQUENCE_MASK: mask}

    def _head_loss(self, tokens: torch.Tensor, extra: dict, targets: torch.Tensor,
                   chunk_tokens: Optional[int], rows: Optional[torch.Tensor]) -> torch.Tensor:
        """The summed loss from the decoder's last hidden state (already normed) and the output
        layer, on `rows` (None: all)."""
        from checkpointing.head import summed_head_loss

        decoder, head = self.hf.get_decoder(), self.hf.get_output_embeddings()
        if tokens.device.type == "meta":  # as for the logits: shapes only, then the head
            from torch._subclasses.fake_tensor import FakeTensorMode

            with FakeTensorMode(allow_non_fake_inputs=True), _masks_as_in_training():
                hidden = decoder(input_ids=tokens, use_cache=False, **extra).last_hidden_state
        else:
            hidden = decoder(input_ids=tokens, use_cache=False, **extra).last_hidden_state
        return summed_head_loss(nn.Identity(), head, hidden, targets, chunk_tokens, rows)

    def flops_per_token(self, seq_len: int) -> float:
        """6 N + 12 L d T, with N the non-embedding parameters counting the output head (a tied
        head once, as the head), as trainer/models/llama.py's flops_per_token for our Llama."""
        embedding = self.hf.get_input_embeddings().weight
        head = self.hf.get_output_embeddings()
        tied = head is not None and head.weight is embedding
        total = sum(p.numel() for p in self.parameters())  # parameters() yields a tied one once
        n = total if tied else total - embedding.numel()
        c = self.hf.config
        return float(6 * n + 12 * c.num_hidden_layers * c.hidden_size * seq_len)

    @torch.no_grad()
    def init_param(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        hf_name = name[len(PREFIX):] if name.startswith(PREFIX) else name
        if self._reader is not None:
            full.copy_(self._reader.get(hf_name, full.shape))
        elif full.ndim >= 2:
            full.normal_(0.0, self._std, generator=generator)
        elif hf_name.endswith("bias"):
            full.zero_()
        else:  # norm scales
            full.fill_(1.0)


def build_hf_on_meta(hf_config: Any, path: Optional[str],
                     attn_implementation: str = "sdpa") -> HFCausalLM:
    """The wrapped model with parameters on meta; `path` also makes init_param load weights."""
    from transformers import AutoModelForCausalLM

    config = _hf_config(hf_config, path)
    config._attn_implementation = attn_implementation
    try:
        with _parameters_on_meta():
            model = AutoModelForCausalLM.from_config(config)
    except ValueError as exc:
        if "attention implementation" not in str(exc) and "attn_implementation" not in str(exc):
            raise
        # transformers' text is a paragraph that names from_pretrained's argument, not ours.
        from trainer.config import ConfigError

        said = str(exc).split(". ")[0].strip()
        raise ConfigError("model.attn_implementation", f"{attn_implementation}: transformers "
                          f"says: {said}; set model.attn_implementation=eager (or another "
                          "the model supports)") from None
    return HFCausalLM(model, checkpoint=path)


def save_pretrained(model_state: Mapping[str, torch.Tensor], hf_config: Any,
                    path: Optional[str], out: str, fields: Optional[Mapping] = None) -> None:
    """Write a folder `from_pretrained` loads: config.json (the HF config the model was built
    from, with `fields` as the run set them, e.g. a fine-tuned classifier's image size and
    labels) and model.safetensors (the parameters under their HF names)."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    state = {k[len(PREFIX):] if k.startswith(PREFIX) else k: v.contiguous()
             for k, v in model_state.items()}
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config = _hf_config(hf_config, path)
    for key, value in (fields or {}).items():
        setattr(config, key, value)
    with open(os.path.join(out, "config.json"), "w") as f:
        f.write(config.to_json_string())


@functools.cache
def _calls_attention_registry(cls: type) -> bool:
    """Whether a module class's forward takes its attention from transformers' registry (the
    test transformers itself makes of whether a model can switch its attention)."""
    try:
        return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def ulysses_options(options: dict, q_heads: int, kv_heads: int, degree: int) -> dict:
    """HF attention's keyword arguments under Ulysses, the same for the real all-to-all and the
    meta trace's: HF's slice-sized `attention_mask` gives way to the whole sequence's, which
    the wrapper's forward put in the SEQUENCE_MASK kwarg (absent, as in the meta trace, or
    None: causal over the whole sequence, SDPA's is_causal), and the slice's `position_ids` go
    (meaningless after the all-to-all). KV heads the degree does not divide are repeated
    before the split (sharding.sequence's kv_repeats, as for the built-in models); HF's
    function then sees this rank's query heads per KV head (`_as_attend`)."""
    from trainer.models.sequence_parallel import SEQUENCE_MASK

    options = dict(options)
    options["attention_mask"] = options.pop(SEQUENCE_MASK, None)
    options.pop("position_ids", None)
    return options


def ring_options(options: dict) -> tuple:
    """(document ids, scale, dropout) of HF attention's keyword arguments for the ring
    (trainer/models/sequence_parallel.py's ring_wrap): the ids the model's forward put in
    RING_DOCUMENTS, HF's own `scaling` and `dropout`. HF's share-sized mask is not used.
    What the ring cannot do (soft-capping, sliding windows) is refused."""
    from trainer.models.sequence_parallel import RING_DOCUMENTS

    for name in ("softcap", "sliding_window"):
        if options.get(name) is not None:
            raise ValueError(f"ring attention (sharding.context > 1) has no {name}; set "
                             "sharding.context=1 for this model")
    return options.get(RING_DOCUMENTS), options.get("scaling"), options.get("dropout", 0.0)


def hf_attention_modules(hf_model: nn.Module) -> list[nn.Module]:
    """The modules of an HF model that call the registry's attention, in forward order."""
    return [m for m in hf_model.modules() if _calls_attention_registry(type(m))]


def _through_attend(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: Optional[torch.Tensor], **kwargs):
    """The registry's function under the "blocktrain+" names: the module's `attend`, returned
    in HF's layout ([B, T, heads, head_dim], no attention weights)."""
    out = module.attend(query, key, value, attention_mask=attention_mask, **kwargs)
    return out.transpose(1, 2), None


class _HeadsOfThisRank:
    """`module` as HF's attention function sees it once Ulysses has repeated and split its KV
    heads: its own attributes, except the query heads per KV head, which HF's functions read
    from the module (num_key_value_groups) to repeat K and V themselves."""

    def __init__(self, module: nn.Module, groups: int) -> None:
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def _as_attend(function: Callable, module: nn.Module) -> Callable[..., torch.Tensor]:
    """An HF attention function (module, q, k, v, mask, **options) -> ([B, T, heads, head_dim],
    weights) as an attend for `module`: (q, k, v, **options) -> [B, heads, T, head_dim]."""
    def attend(query, key, value, **options):
        owner, groups = module, query.shape[1] // key.shape[1]
        if getattr(module, "num_key_value_groups", groups) != groups:
            owner = _HeadsOfThisRank(module, groups)
        return function(owner, query, key, value, **options)[0].transpose(1, 2)
    return attend


def wrap_hf_attention(hf_model: nn.Module, wrap: Callable) -> int:
    """Each attention module of `hf_model` calls `wrap(current)` from now on; returns how many.
    The first wrap registers "blocktrain+<impl>" in transformers' AttentionInterface (with
    <impl>'s own mask function, so masks are made as before) and points the config at it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    modules = hf_attention_modules(hf_model)
    fresh = [(m, m.config._attn_implementation) for m in modules if "attend" not in vars(m)]
    for module, impl in fresh:  # every module's own implementation, before any config changes
        function = (sys.modules[type(module).__module__].eager_attention_forward
                    if impl == "eager" else ALL_ATTENTION_FUNCTIONS[impl])
        module.attend = _as_attend(function, module)
    for module, impl in fresh:
        AttentionInterface.register(ATTENTION + impl, _through_attend)
        AttentionMaskInterface.register(ATTENTION + impl, ALL_MASK_ATTENTION_FUNCTIONS[impl])
        module.config._attn_implementation = ATTENTION + impl
        if hf_model.config._attn_implementation == impl:  # the model's masks follow its layers
            hf_model.config._attn_implementation = ATTENTION + impl
    for module in modules:
        module.attend = wrap(module.attend)
    return len(modules)
