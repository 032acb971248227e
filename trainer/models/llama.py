"""Llama-style decoder-only transformer.

The model is written so that distributed wrappers can be applied from the
outside without touching this file:

* it holds no buffers, so it can be built on the meta device and materialised
  with ``to_empty`` without any re-initialisation step other than parameters;
* every block is called as ``block(hidden, rope)``, or ``block(hidden, rope, mask)``
  for packed sequences, with positional arguments only, so per-block wrappers
  (sharding, recompute, offload) see a uniform signature;
* parameter initialisation is defined on the full, unsharded tensor of each
  parameter with its own seeded generator, so every sharding layout and world
  size produces the same numbers.

Parameter names follow Meta's reference implementation (``attention.wq``,
``feed_forward.w1``, ``attention_norm`` ...) so checkpoints map over by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from checkpointing.head import compute_dtype, summed_head_loss
from checkpointing.tiles import mark_tiled, tiled
from trainer.models.attention_tiles import add_query_tiles, tiled_attention
from trainer.models.doc_attention import DocumentMask, choose_backend, masked_attention
from trainer.models.sequence_parallel import group_place, sliced_rope_and_mask
from trainer.models.llama_counts import (count_params, flops_per_token,  # noqa: F401
                                         init_rule)
from trainer.models.rope import Rope, apply_rope, rope_at, rope_cos_sin  # noqa: F401 (tests)

IGNORE_INDEX = -100  # targets with this value (prompt tokens, padding) carry no loss


@dataclass
class LlamaArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_hidden: int
    max_seq_len: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    dropout: float = 0.0
    tie_embeddings: bool = False
    # Packed batches only: "auto" (FlexAttention on CUDA, an SDPA boolean mask elsewhere),
    # "sdpa" or "flex"; see trainer/models/doc_attention.py.
    packed_attention: str = "auto"
    # One attention head's width when it is not dim // n_heads (Qwen3: model.head_dim).
    head_width: int | None = None

    def __post_init__(self) -> None:
        # Fail at config time rather than with an opaque view()/reshape error mid-forward.
        if self.head_width is None and self.dim % self.n_heads != 0:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")

    @property
    def head_dim(self) -> int:
        return self.head_width or self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The mean of squares over thousands of bf16 values is too coarse, so normalise
        # in float32 (float64 stays) and return in the caller's dtype.
        normed = F.rms_norm(x.to(compute_dtype(x.dtype)), (x.shape[-1],),
                            self.weight.to(compute_dtype(x.dtype)), self.eps)
        return normed.type_as(x)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.dropout = args.dropout
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        # What attends over q, k, v: the hook sequence parallelism wraps
        # (trainer/models/attention.py).
        self.attend = causal_attention

    def forward(self, x: torch.Tensor, rope: Rope,
                mask: DocumentMask | None = None) -> torch.Tensor:
        return self.mix(self.wq(x), self.wk(x), self.wv(x), rope, mask)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """q, k and v of `x` side by side in one [B, T, (heads + 2 kv heads) * head_dim]
        tensor: the token-wise input side that sequence tiles compute (Block.tile)."""
        return torch.cat((self.wq(x), self.wk(x), self.wv(x)), dim=-1)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        kv = self.n_kv_heads * self.head_dim
        return qkv.split((self.n_heads * self.head_dim, kv, kv), dim=-1)

    def mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope,
            mask: DocumentMask | None = None) -> torch.Tensor:
        """wo of the attention of the [B, T, heads * head_dim] projections q, k, v."""
        batch, seq_len, _ = q.shape
        q = q.view(batch, seq_len, self.n_heads, self.head_dim)
        k = k.view(batch, seq_len, self.n_kv_heads, self.head_dim)
        v = v.view(batch, seq_len, self.n_kv_heads, self.head_dim)
        q, k = self.norm_heads(q, k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        # SDPA wants heads before time.
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        # enable_gqa maps query head h to kv head h // (n_heads // n_kv_heads), the same
        # grouping as repeat_interleave, without materialising the repeated kv tensors.
        dropout_p = self.dropout if self.training else 0.0
        gqa = self.n_kv_heads != self.n_heads
        out = self.attend(q, k, v, mask=mask, dropout_p=dropout_p, enable_gqa=gqa)
        out = out.transpose(1, 2).reshape(batch, seq_len, self.n_heads * self.head_dim)
        return self.wo(out)

    def norm_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k [B, T, heads, head_dim] before rotary: unchanged (Qwen3 normalises each head)."""
        return q, k


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     mask: DocumentMask | None = None, dropout_p: float = 0.0,
                     enable_gqa: bool = False) -> torch.Tensor:
    """Causal attention of [B, heads, T, head_dim] q, k, v; inside each document when `mask`
    (packed sequences) is given."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                              enable_gqa=enable_gqa)
    return masked_attention(q, k, v, mask, dropout_p, enable_gqa)


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm transformer block, called as ``block(hidden, rope)`` or, packed,
    ``block(hidden, rope, mask)``.

    In sequence tiles (`tile`), its token-wise parts compute a slice of the tokens at a time
    (checkpointing/tiles.py): attention_norm with wq/wk/wv, ffn_norm with the MLP, and rotary,
    attention (by query tiles) and wo (trainer/models/attention_tiles.py)."""

    attention_class = Attention  # a variant's block swaps its attention (trainer/models/qwen3.py)

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = self.attention_class(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args.dim, args.ffn_hidden)
        self.residual_dropout = nn.Dropout(args.dropout)
        self.tiles = 1  # sequence tiles of the token-wise parts (tile)

    def tile(self, num_tiles: int) -> Block:
        """Compute the token-wise parts in `num_tiles` sequence tiles from now on (1: as
        written). Once per block, before the checkpoint wrapper and fully_shard, so the
        recompute and FSDP's unshard window hold the tiles inside. Parameter names unchanged."""
        for module in (self.attention_norm, self.attention.wq, self.attention.wk,
                       self.attention.wv, self.ffn_norm, self.feed_forward):
            mark_tiled(module, num_tiles)  # refuses a second time
        add_query_tiles(self.attention, num_tiles)
        self.tiles = num_tiles
        return self

    def forward(self, x: torch.Tensor, rope: Rope,
                mask: DocumentMask | None = None) -> torch.Tensor:
        if self.tiles > 1:
            return self._tiled_forward(x, rope, mask)
        h = x + self.residual_dropout(self.attention(self.attention_norm(x), rope, mask))
        return h + self.residual_dropout(self.feed_forward(self.ffn_norm(h)))

    def _tiled_forward(self, x: torch.Tensor, rope: Rope,
                       mask: DocumentMask | None) -> torch.Tensor:
        n = self.tiles
        # The parameters read at every call: FSDP2 swaps in the unsharded ones for the forward.
        qkv = tiled(self._attention_inputs, x, n,
                    _trained(self.attention_norm, self.attention.wq, self.attention.wk,
                             self.attention.wv))
        h = x + self.residual_dropout(tiled_attention(self.attention, qkv, rope, mask, n))
        mlp = tiled(self._mlp_half, h, n, _trained(self.ffn_norm, self.feed_forward))
        return h + self.residual_dropout(mlp)

    def _attention_inputs(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention.project(self.attention_norm(x))

    def _mlp_half(self, h: torch.Tensor) -> torch.Tensor:
        return self.feed_forward(self.ffn_norm(h))


def _trained(*modules: nn.Module) -> list[torch.Tensor]:
    return [p for m in modules for p in m.parameters() if p.requires_grad]


class Llama(nn.Module):
    block_class = Block  # a variant swaps its blocks (trainer/models/qwen3.py)

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(self.block_class(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # The ranks sharing each sample (families/llama.py's sequence_parallel); None: alone.
        self.sequence_group = self.context_group = None  # and the ring's (sharding.context)
        # Sequence tiles of the final norm before the head (tile_head); 1: the whole hidden.
        self.head_tiles = 1
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make the head share the embedding matrix when ``tie_embeddings`` is set.

        Needed again after ``to_empty``/``load_state_dict(assign=True)``, which
        replace each module's parameter separately and so silently untie them.
        """
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def tile_head(self, num_tiles: int) -> None:
        """The final norm computes in `num_tiles` sequence tiles (checkpointing/tiles.py) from
        now on, so its fp32 copies exist for one tile of tokens at a time."""
        mark_tiled(self.norm, num_tiles)
        self.head_tiles = num_tiles

    def _head_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        dim = hidden.dim() - 2  # the tokens: [B, T, d], or the gathered rows [n, d]
        tiles = min(self.head_tiles, hidden.shape[dim])
        if tiles <= 1:
            return self.norm(hidden)
        return tiled(self.norm, hidden, tiles, _trained(self.norm), dim)

    def to_empty(self, *, device: torch.device | str | int | None, recurse: bool = True) -> Llama:
        super().to_empty(device=device, recurse=recurse)
        # Re-tie here so callers that then init via named_parameters() do not
        # initialise (and train) two separate matrices.
        self.tie_weights()
        return self

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                targets: torch.Tensor | None = None, chunk_tokens: int | None = None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, T, vocab]``. ``positions`` ([B, T] integers) marks packed documents:
        rotary angles follow them and attention stays inside each document (a position that
        is not the previous one + 1 starts a document). ``None``: one sequence per row.

        With ``targets`` and ``chunk_tokens`` (checkpointing.head=chunked): the summed
        next-token loss instead, from the fused chunked head (checkpointing/head.py), which
        never holds the whole logits. Inside this forward the output weight is whole under
        FSDP (the root's parameters are gathered once for it), tied or not.

        With ``targets`` and ``rows`` (flat positions into [B * T], checkpointing.head_rows=
        supervised): the summed loss of the head, plain or chunked, on those rows only.

        Sequence parallel (``sequence_group`` set): ``tokens``, ``positions`` and ``targets``
        are this rank's contiguous slice of each row; the result is that slice of the
        whole-sequence result (trainer/models/sequence_parallel.py)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be [batch, seq_len], got shape {tuple(tokens.shape)}")
        seq_len = tokens.shape[1] * group_place(self.sequence_group)[1] * group_place(
            self.context_group)[1]
        if seq_len > self.args.max_seq_len:
            raise ValueError(
                f"sequence length {seq_len} exceeds the model's max_seq_len="
                f"{self.args.max_seq_len}; lower data.seq_len or raise max_seq_len"
            )
        hidden = self.tok_embeddings(tokens)
        backend = (choose_backend(self.args.packed_attention, tokens.device,
                                  self.training and self.args.dropout > 0)
                   if positions is not None else "sdpa")
        # Unpacked rows: blocks are called with (hidden, rope), as before packing.
        rope, masked = sliced_rope_and_mask(tokens, positions, self.args.head_dim,
                                            self.args.rope_theta, backend,
                                            self.sequence_group, self.context_group)
        for block in self.layers:
            hidden = block(hidden, rope, *masked)
        if targets is not None and (chunk_tokens is not None or rows is not None):
            return summed_head_loss(self._head_norm, self.output, hidden, targets, chunk_tokens,
                                    rows, IGNORE_INDEX)
        return self.output(self._head_norm(hidden))

    def param_init_std(self, name: str) -> float | None:
        """Init std for parameter ``name``; ``None`` means fill with ones (norm weights).

        Raises KeyError for names this model does not have.
        """
        return self.init_rule(name)[1]

    def init_rule(self, name: str) -> tuple[tuple[int, ...], float | None]:
        """``(full shape, std)`` of parameter ``name``; a variant adds its own parameters'."""
        return init_rule(self.args, name)

    def init_param(self, name: str, full: torch.Tensor, generator: torch.Generator) -> None:
        """Fill the full (unsharded) tensor of parameter ``name`` in place.

        Rules (why): norms -> 1 (identity at start); embeddings and ordinary linear
        weights -> N(0, 0.02) (GPT-2 scale; the embedding also serves as the head when
        tied, where unit std would give logits of std sqrt(dim)); attention ``wo`` and
        ffn ``w2`` -> N(0, 0.02 / sqrt(2 * n_layers)) because 2 * n_layers of them add
        into the residual stream; untied head -> N(0, dim ** -0.5) so initial logits
        have unit variance over the unit-RMS final hidden state.

        Samples are drawn in float32 on ``generator``'s device and then copied, so the
        values depend only on the generator state and the shape, not on the dtype or
        device of ``full``.
        """
        shape, std = self.init_rule(name)
        if tuple(full.shape) != shape:
            raise ValueError(
                f"{name}: expected the full tensor of shape {shape}, got {tuple(full.shape)}"
                " (pass the unsharded tensor, not a shard)"
            )
        with torch.no_grad():
            if std is None:
                full.fill_(1.0)
                return
            sample = torch.empty(shape, dtype=torch.float32, device=generator.device)
            sample.normal_(mean=0.0, std=std, generator=generator)
            full.copy_(sample)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy of [B, T, vocab] logits, computed in fp32 (fp64 for fp64 logits) whatever
    their dtype: the mean over the targets that are not IGNORE_INDEX (NaN when every target is
    ignored)."""
    logits = logits.flatten(0, 1)
    return F.cross_entropy(logits.to(compute_dtype(logits.dtype)), targets.flatten(0, 1),
                           ignore_index=IGNORE_INDEX)


def next_token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy summed over the targets that are not ignored (-100), in fp32: packed
    documents, where the step divides by the global batch's count of such targets."""
    logits = logits.flatten(0, 1)
    return F.cross_entropy(logits.to(compute_dtype(logits.dtype)), targets.flatten(0, 1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def lm_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
            positions: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token cross entropy of the model's logits for `inputs` (packed when `positions`
    is given; see Llama.forward)."""
    # Without positions the call stays model(inputs): wrappers and models that take no
    # positions keep working.
    logits = model(inputs) if positions is None else model(inputs, positions=positions)
    return next_token_loss(logits, targets)


def build_llama(args: LlamaArgs, device: torch.device | str = "meta") -> Llama:
    """Construct a Llama with its parameters allocated on ``device`` (meta: no memory)."""
    with torch.device(device):
        return Llama(args)


def num_params(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Number of distinct parameters (a tied head/embedding counts once).

    ``exclude_embeddings`` drops the input embedding table unless it is tied, in
    which case it is the output head and stays counted.
    """
    total = sum(p.numel() for p in model.parameters())
    if exclude_embeddings and isinstance(model, Llama) and not model.args.tie_embeddings:
        total -= model.tok_embeddings.weight.numel()
    return total


