"""The chunked, fused linear cross-entropy (checkpointing/head.py) against plain PyTorch: exact in
float64 for every kind of chunking and mask, independent of the chunk size in fp32, traceable by
torch.compile, close to fp32 in bf16, and far below the plain head's live memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from checkpointing.head import SeeInsideHead, chunked_linear_cross_entropy
from checkpointing.plan import default_chunk_tokens
from launch.bench.head import main
from trainer.observe.livebytes import LiveTensorBytes, _LiveTensorBytes

IGNORE = -100


def _data(tokens: int, vocab: int, dim: int, dtype=torch.float64, masked: float = 0.0,
          seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, dim, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, dim, generator=gen, dtype=torch.float64) * dim ** -0.5
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    targets[torch.rand(tokens, generator=gen) < masked] = IGNORE
    return hidden.to(dtype), weight.to(dtype), targets


def _run(loss_fn, hidden, weight, targets, grads=(True, True)):
    """(loss, grad of hidden, grad of weight) of one backward from fresh leaves; the backward
    starts from 0.75, not 1, so that a backward that ignores its incoming gradient shows."""
    hidden = hidden.detach().requires_grad_(grads[0])
    weight = weight.detach().requires_grad_(grads[1])
    loss = loss_fn(hidden, weight, targets)
    (loss * 0.75).backward()
    return loss.detach(), hidden.grad, weight.grad


def _reference(normaliser=None):
    """F.cross_entropy on float64 logits: the mean over supervised tokens, or sum / normaliser."""
    def loss(hidden, weight, targets):
        logits = F.linear(hidden, weight).double()
        if normaliser is None:
            return F.cross_entropy(logits, targets, ignore_index=IGNORE)
        return F.cross_entropy(logits, targets, ignore_index=IGNORE, reduction="sum") / float(
            normaliser)
    return loss


def _chunked(chunk, normaliser=None):
    return lambda h, w, y: chunked_linear_cross_entropy(h, w, y, chunk, normaliser=normaliser)


def _relative(got, want) -> float:
    return ((got - want).norm() / want.norm()).item()


N = 40  # tokens in the float64 cases: chunk 7 leaves 5 in the last chunk, 16 leaves 8
CASES = {  # name: (chunk, masked fraction, tokens ignored by position, normaliser)
    "chunk 1": (1, 0.0, None, None),
    "chunk 7": (7, 0.0, None, None),
    "chunk N": (N, 0.0, None, None),
    "chunk N+3": (N + 3, 0.0, None, None),
    "uneven last chunk": (16, 0.0, None, None),
    "a chunk all ignored": (8, 0.0, slice(8, 16), None),
    "a mask": (7, 0.4, None, None),
    "a mask, outside normaliser": (7, 0.4, None, 123.5),
    "a tensor normaliser": (16, 0.4, None, torch.tensor(64.0)),
}


@pytest.mark.parametrize("case", CASES)
def test_float64_equals_cross_entropy_on_full_logits(case: str) -> None:
    chunk, masked, ignored, normaliser = CASES[case]
    hidden, weight, targets = _data(N, 50, 12, masked=masked)
    if ignored is not None:
        targets[ignored] = IGNORE
    assert (targets == IGNORE).any() == (masked > 0 or ignored is not None)
    got = _run(_chunked(chunk, normaliser), hidden, weight, targets)
    want = _run(_reference(normaliser), hidden, weight, targets)
    for name, g, w in zip(("loss", "grad hidden", "grad weight"), got, want):
        assert g.dtype == torch.float64
        assert _relative(g, w) <= 1e-12, (name, _relative(g, w))
    if ignored is not None:
        assert torch.count_nonzero(got[1][ignored]) == 0  # an ignored token has no gradient


@pytest.mark.parametrize("grads", [(True, False), (False, True)], ids=["frozen head", "hidden"])
def test_only_the_gradients_asked_for(grads) -> None:
    hidden, weight, targets = _data(N, 50, 12, masked=0.3)
    got = _run(_chunked(7), hidden, weight, targets, grads)
    want = _run(_reference(), hidden, weight, targets, grads)
    for g, w, asked in zip(got[1:], want[1:], grads):
        assert (g is None) == (not asked)
        if asked:
            assert _relative(g, w) <= 1e-12
    with torch.no_grad():
        assert _relative(chunked_linear_cross_entropy(hidden, weight, targets, 7), want[0]) < 1e-12


def test_a_kept_graph_gives_the_same_gradients_twice() -> None:
    hidden, weight, targets = _data(N, 50, 12, masked=0.3)
    hidden.requires_grad_()
    loss = chunked_linear_cross_entropy(hidden, weight, targets, 7)
    first, = torch.autograd.grad(loss, hidden, retain_graph=True)
    second, = torch.autograd.grad(loss, hidden)
    assert torch.equal(first, second)


def test_nothing_supervised_is_zero_not_nan() -> None:
    hidden, weight, targets = _data(N, 50, 12)
    targets[:] = IGNORE
    loss, grad_hidden, grad_weight = _run(_chunked(7), hidden, weight, targets)
    assert loss.item() == 0.0
    assert torch.count_nonzero(grad_hidden) == 0 and torch.count_nonzero(grad_weight) == 0


def test_fp32_loss_and_hidden_grad_do_not_depend_on_the_chunk_size() -> None:
    """Bit for bit: each token's loss goes into one buffer summed once, not per-chunk partial
    sums (which differ in the last bits). The chunk sizes are multiples of 16 rows: the matrix
    library itself (MKL) may round a product's row differently when the product has, say, 1 or
    7 rows, which no op above it controls (checked to stay within fp32 rounding below)."""
    tokens = 320
    hidden, weight, targets = _data(tokens, 2000, 64, dtype=torch.float32, masked=0.3)
    runs = {c: _run(_chunked(c), hidden, weight, targets) for c in (16, 48, 96, tokens, 400)}
    loss, grad_hidden, _ = runs[tokens]
    for chunk, (other_loss, other_grad, _) in runs.items():
        assert torch.equal(other_loss, loss), chunk
        assert torch.equal(other_grad, grad_hidden), chunk
    for chunk in (1, 7):
        other_loss, other_grad, _ = _run(_chunked(chunk), hidden, weight, targets)
        torch.testing.assert_close(other_loss, loss, rtol=1e-6, atol=0)
        torch.testing.assert_close(other_grad, grad_hidden, rtol=1e-5, atol=1e-9)


def test_bf16_is_as_close_to_fp32_as_the_plain_bf16_head() -> None:
    """bf16 logits, fp32 log-sum-exp and fp32 weight-gradient sums: against fp32 math on the
    same (bf16-rounded) values, no further off than the plain head in bf16."""
    hidden, weight, targets = _data(512, 3000, 64, dtype=torch.bfloat16, masked=0.25)
    want = _run(_reference(), hidden.double(), weight.double(), targets)
    plain = _run(lambda h, w, y: F.cross_entropy(F.linear(h, w).float(), y), hidden, weight,
                 targets)
    got = _run(_chunked(8), hidden, weight, targets)  # 64 chunks: the weight grad sums them
    assert got[0].dtype == torch.float32
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    for name, g, p, w in zip(("loss", "grad hidden", "grad weight"), got, plain, want):
        error, plain_error = _relative(g.double(), w), _relative(p.double(), w)
        assert error <= 1.5 * plain_error + 1e-7, (name, error, plain_error)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiles_as_one_graph_and_matches_eager(backend: str) -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    hidden, weight, targets = _data(64, 300, 16, dtype=torch.float32, masked=0.3)
    counter = CompileCounterWithBackend(backend)

    def step(h, w, y, normaliser):
        return chunked_linear_cross_entropy(torch.tanh(h), w, y, 24, normaliser=normaliser)

    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for normaliser in (torch.tensor(50.0), torch.tensor(70.0)):
        got = _run(lambda h, w, y: compiled(h, w, y, normaliser), hidden, weight, targets)
        want = _run(lambda h, w, y: step(h, w, y, normaliser), hidden, weight, targets)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-9)
    assert counter.frame_count == 1  # a new tensor normaliser is an input, not a recompile


def _peak(loss_fn, hidden, weight, targets) -> int:
    """Peak live tensor bytes of forward+backward above the inputs, the op's insides seen."""
    hidden, weight = hidden.requires_grad_(), weight.requires_grad_()
    with LiveTensorBytes([hidden, weight, targets]) as live:  # it sees inside (SeeInsideHead)
        loss_fn(hidden, weight, targets).backward()
    return live.peak - live.baseline


def test_memory_is_far_below_the_plain_head() -> None:
    tokens, vocab, dim, chunk = 4096, 32000, 256, 512
    hidden, weight, targets = _data(tokens, vocab, dim, dtype=torch.float32)
    plain = _peak(lambda h, w, y: F.cross_entropy(F.linear(h, w), y), hidden, weight, targets)
    chunked = _peak(_chunked(chunk), hidden.detach(), weight.detach(), targets)
    logits = tokens * vocab * 4
    grads = (tokens + vocab) * dim * 4
    assert plain >= 2 * logits  # the measure sees the plain head's logits and their gradient
    # One chunk's logits (in place in fp32) and the gradients (computed in the forward, scaled
    # in the backward: twice), with room for small tensors: an eighth of the full logits here.
    assert chunked <= 1.2 * (chunk * vocab * 4 + 3 * grads), chunked
    assert chunked < plain / 8, (chunked, plain)


def test_the_op_sees_inside_for_the_memory_measure() -> None:
    """Without SeeInsideHead the custom op is one node and its chunk logits go unseen."""
    hidden, weight, targets = _data(256, 4000, 16, dtype=torch.float32)
    assert issubclass(LiveTensorBytes, SeeInsideHead)
    with _LiveTensorBytes([hidden, weight, targets]) as blind:
        chunked_linear_cross_entropy(hidden, weight, targets, 256)
    seen = _peak(_chunked(256), hidden, weight, targets)
    assert blind.peak - blind.baseline < 256 * 4000 * 4 <= seen


def test_default_chunk_from_the_byte_budget() -> None:
    assert default_chunk_tokens(128256) == 523  # 256 MiB / (128256 x 4 bytes)
    assert default_chunk_tokens(32000) == 2097
    assert default_chunk_tokens(1000, budget_bytes=4000 * 7) == 7  # exactly 7 rows fit
    assert default_chunk_tokens(1000, budget_bytes=4000 * 7 - 1) == 6
    assert default_chunk_tokens(10**9) == 1
    with pytest.raises(ValueError):
        default_chunk_tokens(0)


@pytest.mark.parametrize("bad, message", [
    ({"chunk_tokens": 0}, "chunk_tokens must be at least 1"),
    ({"normaliser": 0.0}, "normaliser must be positive"),
    ({"weight": torch.zeros(50, 11, dtype=torch.float64)}, "want hidden [..., d]"),
    ({"weight": torch.zeros(50, 12)}, "hidden is torch.float64 but weight is torch.float32"),
    ({"targets": torch.zeros(39, dtype=torch.long)}, "39 targets for 40 tokens"),
])
def test_bad_input_is_one_line(bad, message) -> None:
    hidden, weight, targets = _data(N, 50, 12)
    args = {"hidden": hidden, "weight": weight, "targets": targets, "chunk_tokens": 8, **bad}
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(".", r"\.")):
        chunked_linear_cross_entropy(**args)


def test_leading_dimensions_are_flattened() -> None:
    hidden, weight, targets = _data(N, 50, 12)
    flat = chunked_linear_cross_entropy(hidden, weight, targets, 7)
    assert torch.equal(chunked_linear_cross_entropy(hidden.view(4, 10, 12), weight,
                                                    targets.view(4, 10), 7), flat)


def test_benchmark_prints_both_heads(capsys) -> None:
    rows = main(["--tokens", "64", "--vocab", "100,300", "--dim", "8", "--repeats", "1"])
    out = capsys.readouterr().out
    assert [r["vocab"] for r in rows] == [100, 300] and "chunked peak MiB" in out
    assert all(r["chunked_s"] > 0 and 0 < r["chunked_peak"] < r["plain_peak"] for r in rows)
