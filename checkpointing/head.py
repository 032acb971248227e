"""The loss head as one fused, chunked op: linear layer, cross-entropy and both gradients.

    loss = chunked_linear_cross_entropy(hidden, weight, targets, chunk_tokens)

equals `F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum") / normaliser`
(normaliser: the supervised tokens, or one given from outside) without the [tokens, vocab] logits
ever existing: for each chunk of tokens the op makes the chunk's logits in the head's dtype, its
log-sum-exp and losses in fp32, and, right there in the forward, the chunk's gradients with
respect to the hidden states and the weight. The backward only scales them by the incoming
gradient, so nothing is recomputed. The live memory of the head is then one chunk's logits (a few
copies of [chunk, vocab]) plus the gradients the step needs anyway, flat in the sequence length.

Determinism: every token's loss is written into one [tokens] buffer that is summed once at the
end, so the loss's summation order does not depend on the chunking; a token's gradient row
depends only on its own logits. What no pure-PyTorch op controls is the matrix library: MKL (and
cuBLAS) may round a row of a product differently when the product has another number of rows (on
the CI CPU, chunks of 1 or 7 rows change a token's hidden gradient in the last bit; chunks that
are whole multiples of 16 rows do not).

    python -m launch.bench.head --tokens 4096 --vocab 32000,128256 --dim 512

times forward+backward of this op against the plain head and measures the peak of live tensor
bytes of both.

Supervised rows (checkpointing.head_rows=supervised). With assistant-only chat loss a third of
the positions carry a target; `supervised_rows` picks them and `summed_head_loss` runs the head,
plain or chunked, on those rows only (gathered before the final norm), so its FLOPs and memory
scale with the supervised tokens. What stays equal bit for bit: each row's logits, loss and
hidden-state gradient (row-local); what moves in the last bits: the loss's sum and the weight
gradient's, whose terms are the same but summed in another grouping (a product over fewer rows).
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

OP_NAME = "blocktrain::chunked_linear_cross_entropy"


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor,
                                 targets: torch.Tensor, chunk_tokens: int,
                                 normaliser: Union[float, torch.Tensor, None] = None,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Sum over the tokens whose target is not `ignore_index` of cross_entropy(hidden @ weight.T,
    target), divided by `normaliser` (None: the number of such tokens, at least 1).

    hidden [tokens, d] (leading dimensions are flattened), weight [vocab, d] of the same dtype,
    targets [tokens] integers. Under torch.compile give a normaliser that changes from step to
    step as a 0-dim tensor (any device): it is then a graph input, where a Python float is a
    constant that recompiles the graph for every new value. Gradients flow to whichever of
    hidden and weight requires them; the other's is never computed. The loss is fp32 (fp64 for
    fp64 inputs).
    """
    if hidden.dim() < 2 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)}: want "
                         "hidden [..., d] and weight [vocab, d]")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden is {hidden.dtype} but weight is {weight.dtype}")
    tokens = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    targets = targets.reshape(-1)
    if targets.shape[0] != tokens.shape[0]:
        raise ValueError(f"{targets.shape[0]} targets for {tokens.shape[0]} tokens")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, not {chunk_tokens}")
    if normaliser is not None and not isinstance(normaliser, torch.Tensor):
        if not normaliser > 0:
            raise ValueError(f"normaliser must be positive, not {normaliser}")
        normaliser = torch.tensor(normaliser, dtype=torch.float64)
    grad = torch.is_grad_enabled()
    # The op by its CustomOpDef, not torch.ops.blocktrain...: launch/torch_api.py looks every
    # dotted torch name up in a bare torch, where the op is not registered.
    loss, _, _ = _op(tokens, weight, targets, int(chunk_tokens), normaliser, int(ignore_index),
                     grad and tokens.requires_grad, grad and weight.requires_grad)
    return loss


# Gathered rows are padded with ignored ones to a multiple of this: the matrix library (MKL,
# cuBLAS) may round a row of a product differently when the product has a ragged number of rows,
# and whole multiples of 16 keep each row's logits and hidden gradient bit for bit.
ROW_MULTIPLE = 16


def supervised_rows(targets: torch.Tensor, ignore_index: int = -100,
                    meta_fraction: float = 1.0) -> Optional[torch.Tensor]:
    """Flat indices of the targets that are not `ignore_index`, in order, then as many ignored
    ones as round their number up to ROW_MULTIPLE (they add exact zeros); None when that is
    every row (the head then runs on all of them, as it always did). Reading the count is one
    host sync. On meta, which has no values, the first ceil(meta_fraction * tokens) rows stand
    for them: the share the memory model plans for."""
    flat = targets.reshape(-1)
    total = flat.numel()
    if flat.device.type == "meta":
        count = math.ceil(meta_fraction * total)
        count = min(total, -(-count // ROW_MULTIPLE) * ROW_MULTIPLE)
        return None if count >= total else torch.arange(count, device=flat.device)
    ignored = flat == ignore_index
    count = total - int(ignored.sum())
    count = min(total, -(-count // ROW_MULTIPLE) * ROW_MULTIPLE)
    if count == total:
        return None
    # A stable sort puts the supervised positions first, each kind in its own order.
    return torch.sort(ignored.to(torch.uint8), stable=True).indices[:count]


def take_rows(x: torch.Tensor, rows: Optional[torch.Tensor]) -> torch.Tensor:
    """x [..., d] (or targets [...]) as the [n, d] ([n]) of `rows` of its flattened leading
    dimensions; x itself, unflattened, for None."""
    if rows is None:
        return x
    flat = x.reshape(-1, x.shape[-1]) if x.dim() > 1 and x.is_floating_point() else x.reshape(-1)
    return flat.index_select(0, rows)


def summed_head_loss(norm: Callable[[torch.Tensor], torch.Tensor], output: torch.nn.Linear,
                     hidden: torch.Tensor, targets: torch.Tensor, chunk_tokens: Optional[int],
                     rows: Optional[torch.Tensor], ignore_index: int = -100) -> torch.Tensor:
    """The next-token cross-entropy summed over the targets (fp32), of the head
    `output(norm(hidden))` on `rows` only (flat positions; None: all): the plain head (logits,
    then cross-entropy) or, with chunk_tokens, the fused chunked one. A slice with no supervised
    row gives 0 and zero gradients."""
    hidden, targets = take_rows(hidden, rows), take_rows(targets, rows)
    if chunk_tokens is not None:
        return chunked_linear_cross_entropy(norm(hidden), output.weight, targets, chunk_tokens,
                                            normaliser=1.0, ignore_index=ignore_index)
    logits = output(norm(hidden))
    logits = logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(logits.to(compute_dtype(logits.dtype)), targets.reshape(-1),
                           ignore_index=ignore_index, reduction="sum")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where the exponentials and sums run: fp32, or fp64 for fp64 heads (and models: rotary,
    RMSNorm, the loss). A dtype test, not torch.promote_types: that is a dispatched op, which
    launch.bench --reference's meter counts on every call."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
           inverse: torch.Tensor, need_grad: bool):
    """One chunk: (per-token losses [chunk] in fp32, gradient of the scaled loss sum w.r.t. the
    chunk's logits [chunk, vocab] in the head's dtype, or None)."""
    compute = compute_dtype(hidden.dtype)
    # The big matmul runs in the head's dtype (bf16 on a GPU), as the plain head's does.
    logits = hidden @ weight.T
    # The exponentials and sums in fp32; for an fp32 head this is the same tensor, which is then
    # overwritten in place below: one [chunk, vocab] buffer where the plain head has three.
    x = logits.to(compute)
    del logits
    valid = targets != ignore_index
    safe = torch.where(valid, targets, 0).unsqueeze(1)  # ignored targets index column 0, unused
    # The log-sum-exp by hand, in place: torch.logsumexp would make a second [chunk, vocab]
    # buffer and pass over it three more times; the exponentials are then the softmax's too.
    x.sub_(x.amax(dim=1, keepdim=True))
    shifted_target = x.gather(1, safe).squeeze(1)
    total = x.exp_().sum(dim=1)
    losses = torch.where(valid, total.log() - shifted_target, 0.0)
    if not need_grad:
        return losses, None
    # d(loss)/d(logits) = (softmax - onehot) / normaliser on supervised rows, 0 on ignored ones.
    row_scale = (valid.to(compute) * inverse).unsqueeze(1)
    x.mul_(row_scale / total.unsqueeze(1))
    # gather + scatter_ rather than scatter_add_: deterministic on CUDA too.
    x.scatter_(1, safe, x.gather(1, safe) - row_scale)
    return losses, x.to(hidden.dtype)


def _accumulate(acc: Optional[torch.Tensor], grad_logits: torch.Tensor,
                hidden: torch.Tensor) -> torch.Tensor:
    """acc + grad_logits.T @ hidden, the weight gradient summed over chunks in fp32 (fp64)."""
    if acc is None:
        # The first chunk's product as it comes: a single chunk needs no fp32 buffer, and casting
        # it to fp32 and back would give the same bits.
        return grad_logits.T @ hidden
    if grad_logits.dtype == compute_dtype(grad_logits.dtype):
        return acc.addmm_(grad_logits.T, hidden)  # fp32/fp64 head: in place, no temporary
    if acc.dtype != torch.float32:
        acc = acc.float()
    # A bf16/fp16 head: the product in the head's dtype (tensor cores), summed in fp32.
    return acc.add_(grad_logits.T @ hidden)


def fused_forward(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                  chunk_tokens: int, normaliser: Optional[torch.Tensor], ignore_index: int,
                  need_hidden_grad: bool, need_weight_grad: bool):
    """The op's body: (loss, grad of loss w.r.t. hidden or empty, w.r.t. weight or empty)."""
    compute = compute_dtype(hidden.dtype)
    tokens = hidden.shape[0]
    if normaliser is None:
        # As a tensor: no host sync here, and a micro-batch with nothing supervised gives 0.
        denominator = (targets != ignore_index).sum().to(compute).clamp_min(1)
    else:
        denominator = normaliser.to(device=hidden.device, dtype=compute)
    inverse = 1.0 / denominator
    need_grad = need_hidden_grad or need_weight_grad
    # Per-token losses summed once at the end: the loss does not depend on the chunking.
    losses = hidden.new_empty(tokens, dtype=compute)
    grad_hidden = hidden.new_empty(hidden.shape if need_hidden_grad else (0,))
    acc = None
    for start in range(0, tokens, chunk_tokens):
        stop = min(start + chunk_tokens, tokens)
        chunk = hidden[start:stop]
        chunk_losses, grad_logits = _chunk(chunk, weight, targets[start:stop], ignore_index,
                                           inverse, need_grad)
        losses[start:stop] = chunk_losses
        if need_hidden_grad:
            torch.mm(grad_logits, weight, out=grad_hidden[start:stop])
        if need_weight_grad:
            acc = _accumulate(acc, grad_logits, chunk)
        del grad_logits, chunk_losses  # before the next chunk's logits exist
    loss = losses.sum() / denominator
    if not need_weight_grad:
        grad_weight = weight.new_empty((0,))
    elif acc is None:  # no tokens
        grad_weight = torch.zeros_like(weight, memory_format=torch.contiguous_format)
    else:
        grad_weight = acc.to(weight.dtype)
    return loss, grad_hidden, grad_weight


_SCHEMA = ("(Tensor hidden, Tensor weight, Tensor targets, int chunk_tokens, Tensor? normaliser, "
           "int ignore_index, bool need_hidden_grad, bool need_weight_grad) "
           "-> (Tensor, Tensor, Tensor)")


@torch.library.custom_op(OP_NAME, mutates_args=(), schema=_SCHEMA)
def _op(hidden, weight, targets, chunk_tokens, normaliser, ignore_index, need_hidden_grad,
        need_weight_grad):
    # Opaque to torch.compile: the loop runs eagerly inside a compiled graph, the graph sees one
    # node with the shapes the fake below gives.
    return fused_forward(hidden, weight, targets, chunk_tokens, normaliser, ignore_index,
                         need_hidden_grad, need_weight_grad)


@_op.register_fake
def _(hidden, weight, targets, chunk_tokens, normaliser, ignore_index, need_hidden_grad,
      need_weight_grad):
    loss = hidden.new_empty((), dtype=compute_dtype(hidden.dtype))
    grad_hidden = hidden.new_empty(hidden.shape if need_hidden_grad else (0,))
    grad_weight = weight.new_empty(weight.shape if need_weight_grad else (0,))
    return loss, grad_hidden, grad_weight


def _setup_context(ctx, inputs, output) -> None:
    _, grad_hidden, grad_weight = output
    # The gradients are results, not something to differentiate: only the loss carries a
    # gradient, and the backward gets None for them rather than zeros of [tokens, d] and [vocab, d].
    ctx.mark_non_differentiable(grad_hidden, grad_weight)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(grad_hidden, grad_weight)
    ctx.need = inputs[6], inputs[7]


def _backward(ctx, grad_loss, _grad_hidden, _grad_weight):
    grad_hidden, grad_weight = ctx.saved_tensors
    need_hidden, need_weight = ctx.need
    # Out of place, so that a graph kept with retain_graph=True gives the same gradients twice.
    return (grad_hidden * grad_loss if need_hidden else None,
            grad_weight * grad_loss if need_weight else None,
            None, None, None, None, None, None)


_op.register_autograd(_backward, setup_context=_setup_context)


class SeeInsideHead:
    """Mixin for a dispatch mode that measures memory (metatrace.LiveBytes, or the trainer's
    LiveTensorBytes in the tests): a custom op is a single node to a dispatch mode, so its
    temporaries (the chunk's logits) would go unseen; this runs the op's body under the mode."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name() == OP_NAME:
            with self:
                return fused_forward(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)
