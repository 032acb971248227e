"""The built-in Qwen3, dense (`model.arch=qwen3`, trainer/models/qwen3.py): the built-in Llama with
a per-head RMSNorm of query and key before rotary; its shapes are the model.* fields (model.head_dim
when a head is not model.dim / model.n_heads wide). Everything else is the Llama family's: its
settings' rules, blocks, attention hook, tiles, sequence parallelism and task; it exports a folder
transformers' Qwen3ForCausalLM loads."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from trainer.config import ModelConfig
from trainer.models.families.llama import Llama, llama_args

if TYPE_CHECKING:
    from torch import nn


class Qwen3(Llama):
    arch = "qwen3"
    hf_architecture = "Qwen3ForCausalLM"
    hf_layer_names = {**Llama.hf_layer_names,
                      "attention.q_norm.weight": "self_attn.q_norm.weight",
                      "attention.k_norm.weight": "self_attn.k_norm.weight"}
    # The head norms' weights are per feature of a head: reordered as wq's rows are.
    rotary_rows = (*Llama.rotary_rows, "attention.q_norm.weight", "attention.k_norm.weight")

    def build_on_meta(self, m: ModelConfig) -> nn.Module:
        from trainer.models.qwen3 import build_qwen3

        return build_qwen3(llama_args(m), device="meta")

    def flops_per_token(self, m: ModelConfig, model: nn.Module, tokens_per_sample: int) -> float:
        from trainer.models.qwen3 import flops_per_token

        return flops_per_token(llama_args(m), tokens_per_sample)

    def hf_config(self, model: Mapping) -> dict:
        return {**super().hf_config(model), "use_sliding_window": False}


FAMILY = Qwen3()
