"""The built-in Llama's shapes in numbers: each parameter's full shape and init std, the
parameter count and the training FLOPs per token, from LlamaArgs alone (no model built)."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.models.llama import LlamaArgs

# Prefixes that wrappers (activation checkpointing, torch.compile, FSDP1) insert into
# parameter names; stripped so seeds and init rules do not depend on the wrapping.
_LAYER_PARAM = re.compile(r"layers\.(\d+)\.(.+)")


def init_rule(args: LlamaArgs, name: str) -> tuple[tuple[int, ...], float | None]:
    """``(full shape, std)`` for a canonical parameter name; std ``None`` means ones."""
    base_std = 0.02
    residual_std = base_std / math.sqrt(2 * args.n_layers)
    q_out = args.n_heads * args.head_dim
    kv_out = args.n_kv_heads * args.head_dim
    if name == "tok_embeddings.weight":
        return (args.vocab_size, args.dim), base_std
    if name == "output.weight":
        # When tied this is the same tensor as the embedding; one rule keeps the
        # numbers independent of which of the two names a caller used.
        std = base_std if args.tie_embeddings else args.dim**-0.5
        return (args.vocab_size, args.dim), std
    if name == "norm.weight":
        return (args.dim,), None
    match = _LAYER_PARAM.fullmatch(name)
    if match is not None and int(match.group(1)) < args.n_layers:
        layer_rules: dict[str, tuple[tuple[int, ...], float | None]] = {
            "attention_norm.weight": ((args.dim,), None),
            "ffn_norm.weight": ((args.dim,), None),
            "attention.wq.weight": ((q_out, args.dim), base_std),
            "attention.wk.weight": ((kv_out, args.dim), base_std),
            "attention.wv.weight": ((kv_out, args.dim), base_std),
            "attention.wo.weight": ((args.dim, q_out), residual_std),
            "feed_forward.w1.weight": ((args.ffn_hidden, args.dim), base_std),
            "feed_forward.w3.weight": ((args.ffn_hidden, args.dim), base_std),
            "feed_forward.w2.weight": ((args.dim, args.ffn_hidden), residual_std),
        }
        if match.group(2) in layer_rules:
            return layer_rules[match.group(2)]
    raise KeyError(f"no init rule for parameter {name!r}")


def count_params(args: LlamaArgs, exclude_embeddings: bool = False) -> int:
    """Parameter count from the config alone, equal to ``num_params`` of the built model."""
    q_out = args.n_heads * args.head_dim
    kv_out = args.n_kv_heads * args.head_dim
    attention = args.dim * q_out * 2 + args.dim * kv_out * 2
    ffn = 3 * args.dim * args.ffn_hidden
    per_layer = attention + ffn + 2 * args.dim
    head = args.vocab_size * args.dim
    non_embedding = args.n_layers * per_layer + args.dim + head
    if exclude_embeddings or args.tie_embeddings:
        return non_embedding
    return non_embedding + args.vocab_size * args.dim


def flops_per_token(args: LlamaArgs, seq_len: int) -> float:
    """Model FLOPs per trained token (forward + backward), for MFU.

    ``6 * N + 12 * n_layers * (n_heads * head_dim) * seq_len``, the estimate from
    the PaLM paper's appendix (also used by nanoGPT): 6 * N covers the matmuls with
    every non-embedding weight (2 forward + 4 backward FLOPs per multiply-add), with
    N counting the output head but not the embedding lookup, which is a gather; the
    second term covers the attention score and value matmuls, which have no weights.
    A tied head is counted once, as the head. The causal mask is ignored, as in the
    reference, so this is the conventional (not the minimal) count.
    """
    n_non_embedding = count_params(args, exclude_embeddings=True)
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * seq_len
    return float(6 * n_non_embedding + attention)
