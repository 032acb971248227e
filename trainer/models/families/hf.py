"""Hugging Face causal language models (`model.arch=hf`, trainer/models/hf.py): any
AutoModelForCausalLM, from a local pretrained folder (model.path) or built from model.hf_config;
its shapes, vocabulary and dropout are the HF config's. Its attention goes through transformers'
attention registry (AttentionInterface), which is where wrap_attention reaches it."""

from __future__ import annotations

import difflib
import os
from typing import TYPE_CHECKING, Callable, Mapping, Optional

from trainer.config import ConfigError, ModelConfig, require
from trainer.models.families.base import LanguageModel
from trainer.models.hf_settings import (HF_IMPLEMENTATIONS, bent_logit_fields, check_hf_source,
                                          hf_fields)

if TYPE_CHECKING:
    import torch
    from torch import nn


class HFCausalLM(LanguageModel):
    arch = "hf"
    vocab_key = "model.hf_config.vocab_size"

    def validate(self, m: ModelConfig, seq_len: int) -> None:
        check_hf_source(m)
        require(m.dropout == 0, "model.dropout",
                "unused with model.arch=hf; set the HF config's own dropout fields instead")

    def vocab_size(self, m: ModelConfig) -> int:
        # 32000 is what transformers' Llama config defaults to when vocab_size is not given.
        return int(hf_fields(m).get("vocab_size", 32000))

    def own_tokenizer(self, m: ModelConfig) -> Optional[str]:
        return m.path

    def adapter_tensor(self, name: str, tensor: torch.Tensor,
                       model: Mapping) -> tuple[str, torch.Tensor]:
        """transformers' names are the model's own, under the wrapper's `hf.`."""
        return name.removeprefix("hf."), tensor

    def check_deep(self, m: ModelConfig) -> None:
        """The model type is one transformers knows, and it has a causal LM."""
        model_type = hf_fields(m).get("model_type")
        key = "model.hf_config.model_type" if m.path is None else "model.path"
        where = "" if m.path is None else f"{os.path.join(m.path, 'config.json')}: "
        if not isinstance(model_type, str):
            raise ConfigError(key, f"{where}no model_type (e.g. llama, gpt2, qwen2)")
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        causal = list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
        if model_type not in CONFIG_MAPPING_NAMES:
            close = difflib.get_close_matches(model_type, causal, 3)
            raise ConfigError(key, f"{where}model_type {model_type!r} is not one transformers "
                              "knows" + (f"; did you mean {', '.join(close)}?" if close else
                                         " (e.g. llama, gpt2, qwen2, mistral)"))
        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise ConfigError(key, f"{where}model_type {model_type!r} has no causal language "
                              "model in transformers (model=hf trains AutoModelForCausalLM)")

    def build_on_meta(self, m: ModelConfig) -> nn.Module:
        from trainer.models.hf import build_hf_on_meta

        return build_hf_on_meta(m.hf_config, m.path, attn_implementation=m.attn_implementation)

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        from trainer.models.hf import hf_attention_modules

        return hf_attention_modules(model.hf)

    def wrap_attention(self, model: nn.Module, wrap: Callable) -> int:
        from trainer.models.hf import wrap_hf_attention

        return wrap_hf_attention(model.hf, wrap)

    tileable = True

    def check_sequence(self, m: ModelConfig, degree: int) -> None:
        """Without torch: an implementation whose whole-sequence mask we build (sdpa, eager),
        and a degree dividing the query heads (KV heads it does not divide are repeated before
        the all-to-all, as for the built-in models). Heads the config's fields do not name are
        checked on the meta model (check_sequence_parallel)."""
        key = "model.attn_implementation"
        if m.attn_implementation not in HF_IMPLEMENTATIONS:
            raise ConfigError(key, f"{m.attn_implementation!r} cannot run sequence-parallel "
                              f"(sharding.sequence={degree}); use one of "
                              f"{', '.join(HF_IMPLEMENTATIONS)}")
        fields = hf_fields(m)
        heads = fields.get("num_attention_heads")
        kv_heads = fields.get("num_key_value_heads") or heads
        if isinstance(heads, int) and isinstance(kv_heads, int):
            _divides_heads(degree, heads, kv_heads)

    def check_sequence_parallel(self, m: ModelConfig, degree: int = 1) -> None:
        """Sequence parallelism reaches an HF model only through transformers' attention
        registry, with an implementation whose whole-sequence mask it builds (sdpa, eager);
        anything else is refused naming model.attn_implementation. The heads are read from
        the built config (whatever its fields are called) and checked against `degree`."""
        key = "model.attn_implementation"
        self.check_sequence(m, 1)
        model = self.build_on_meta(m)
        heads = model.hf.config.num_attention_heads
        _divides_heads(degree, heads, getattr(model.hf.config, "num_key_value_heads", None)
                       or heads)
        layers = getattr(model.hf.config, "num_hidden_layers", None)
        found = len(self.attention_modules(model))
        if found == 0 or (layers is not None and found != layers):
            raise ConfigError(key, f"this {model.hf.config.model_type} model's attention does "
                              f"not go through transformers' attention registry in every layer "
                              f"({found} of {layers}); it cannot run sequence-parallel")

    def check_context(self, m: ModelConfig, context: int, compiled: bool = False) -> None:
        """Without torch: the ring replaces an sdpa or eager attention of a causal decoder;
        it has no attention dropout, sliding window or soft-capping, so a config setting one
        is refused naming it (the registry hook itself is checked on the meta model)."""
        if m.attn_implementation not in HF_IMPLEMENTATIONS:
            raise ConfigError("model.attn_implementation", f"{m.attn_implementation!r} cannot "
                              f"run through the ring (sharding.context={context}); use one "
                              f"of {', '.join(HF_IMPLEMENTATIONS)}")
        fields = hf_fields(m)
        if fields.get("attention_dropout"):
            raise ConfigError("model.hf_config", f"attention_dropout="
                              f"{fields['attention_dropout']}: ring attention (sharding."
                              f"context={context}) has none; set attention_dropout: 0")
        for name in ("sliding_window", "attn_logit_softcapping"):
            if fields.get(name) is not None and fields.get("use_sliding_window", True):
                raise ConfigError("sharding.context", f"this model sets {name}="
                                  f"{fields[name]}, which ring attention does not apply; set "
                                  "sharding.context=1 (sharding.sequence serves it)")

    def ring_options(self) -> Callable[[dict], tuple]:
        """HF's scaling, dropout and the ring place's document ids (trainer/models/hf.py)."""
        from trainer.models.hf import ring_options

        return ring_options

    def ulysses_options(self) -> Callable[[dict, int, int, int], dict]:
        """HF's slice-sized mask and positions give way to the whole sequence's
        (trainer/models/hf.py's ulysses_options)."""
        from trainer.models.hf import ulysses_options

        return ulysses_options

    def mlp_of(self, block: nn.Module) -> Optional[nn.Module]:
        """Llama-style decoder layers (Llama, Mistral, Qwen, Gemma, GPT-2, ...) call theirs
        `mlp`."""
        return getattr(block, "mlp", None)

    def sequence_parallel(self, model: nn.Module, group, context_group=None) -> int:
        """As the built-in Llama's (families/llama.py): every attention module's registered
        function runs inside Ulysses' all-to-all, with the whole sequence's mask instead of
        HF's slice-sized one; `positions` are the slice of the packed positions, or None for
        unpacked rows (the model passes the slice's global positions as position_ids). The
        model's implementation must pass check_sequence_parallel; KV heads the group does not
        divide are repeated before the split. With `context_group` (sharding.context) the
        registered function is the ring's (trainer/models/hf.py's ring_options: HF's scaling,
        the ring place's document ids) inside Ulysses' wrap. Returns the attention modules
        wrapped."""
        from sharding.sequence import GroupExchange

        implementation = model.hf.config._attn_implementation
        if implementation not in HF_IMPLEMENTATIONS:
            raise ConfigError("model.attn_implementation", f"{implementation!r} cannot run "
                              f"sequence-parallel; use one of {', '.join(HF_IMPLEMENTATIONS)}")
        wrapped = 0
        if context_group is not None:  # the ring first, Ulysses' wrap around it
            wrapped = self.wrap_ring(model, context_group)
            model.context_group = context_group
        if group is not None:
            wrapped = self.wrap_ulysses(model, GroupExchange(group))
            model.sequence_group = group
        if wrapped == 0:
            raise ConfigError("model.attn_implementation", "this model's attention does not "
                              "go through transformers' attention registry")
        model.sequence_implementation = implementation
        return wrapped

    def context_length(self, m: ModelConfig, model: nn.Module) -> Optional[int]:
        """The HF config's own bound (model.max_seq_len is unused here)."""
        return getattr(model.hf.config, "max_position_embeddings", None)

    def check_fused_head(self, m: ModelConfig) -> None:
        hf = self.build_on_meta(m).hf
        bent = bent_logit_fields(hf.config)
        if bent:
            raise ConfigError("checkpointing.head", f"chunked computes logits as hidden @ W.T; "
                              f"this {hf.config.model_type} model also applies "
                              f"{', '.join(bent)}: use checkpointing.head=plain")
        head = hf.get_output_embeddings()
        if head is None or getattr(head, "bias", None) is not None or head.weight.dim() != 2:
            raise ConfigError("checkpointing.head", "chunked needs the model's output projection "
                              "(get_output_embeddings(): a Linear without bias); this model has "
                              f"{type(head).__name__ if head is not None else 'none'}: use "
                              "checkpointing.head=plain")

    def export(self, tensors: Mapping[str, torch.Tensor], model: Mapping, out: str, step: int,
               checkpoint: str) -> str:
        """A folder `from_pretrained` loads: HF names and the HF config."""
        from trainer.models.hf import save_pretrained

        save_pretrained(tensors, model.get("hf_config"), model.get("path"), out)
        return out


def _divides_heads(degree: int, heads: int, kv_heads: int) -> None:
    """The degree divides the query heads; KV heads it does not divide are repeated before
    the split (sharding/degrees.py's kv_repeats), so the KV heads do not bound it."""
    from sharding.degrees import kv_repeats

    try:
        kv_repeats(heads, kv_heads, degree)
    except ValueError as exc:
        raise ConfigError("sharding.sequence", f"{exc} (the HF model's attention heads "
                          f"{heads}, KV heads {kv_heads})") from None


FAMILY = HFCausalLM()
