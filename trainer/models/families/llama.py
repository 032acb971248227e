"""The built-in Llama (`model.arch=llama`, trainer/models/llama.py): a decoder-only language model
whose shapes are the model.* fields, initialised from its own seeded rules."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer.config import ModelConfig
from trainer.models.families.base import LanguageModel

if TYPE_CHECKING:
    from torch import nn

    from trainer.models.llama import LlamaArgs


def llama_args(m: ModelConfig) -> LlamaArgs:
    from trainer.models.llama import LlamaArgs

    return LlamaArgs(dim=m.dim, n_layers=m.n_layers, n_heads=m.n_heads,
                     n_kv_heads=m.n_kv_heads, vocab_size=m.vocab_size,
                     ffn_hidden=m.ffn_hidden, max_seq_len=m.max_seq_len,
                     norm_eps=m.norm_eps, rope_theta=m.rope_theta, dropout=m.dropout,
                     tie_embeddings=m.tie_embeddings)


class Llama(LanguageModel):
    arch = "llama"

    def build_on_meta(self, m: ModelConfig) -> nn.Module:
        from trainer.models.llama import build_llama

        return build_llama(llama_args(m), device="meta")

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        from trainer.models.llama import Attention

        return [module for module in model.modules() if isinstance(module, Attention)]

    def flops_per_token(self, m: ModelConfig, model: nn.Module, tokens_per_sample: int) -> float:
        from trainer.models.llama import flops_per_token

        return flops_per_token(llama_args(m), tokens_per_sample)


FAMILY = Llama()
