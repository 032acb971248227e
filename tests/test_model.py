"""Tests for trainer.models.llama: shapes, attention semantics, rotary, init and dropout."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import preset
from trainer.build import init_params, param_seed
from trainer.models.llama import (
    Llama,
    LlamaArgs,
    apply_rope,
    build_llama,
    count_params,
    flops_per_token,
    num_params,
    rope_cos_sin,
)


def tiny_model(**overrides: object) -> Llama:
    args = dataclasses.replace(preset("tiny"), **overrides)
    model = build_llama(args, device="cpu")
    init_params(model, seed=0)
    return model


def random_tokens(batch: int, seq_len: int, vocab: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq_len), generator=generator)


def test_tiny_forward_shape_and_dtype() -> None:
    model = tiny_model()
    logits = model(random_tokens(2, 16, 256))
    assert logits.shape == (2, 16, 256)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_bf16_model_returns_bf16_logits() -> None:
    model = tiny_model().to(torch.bfloat16)
    logits = model(random_tokens(1, 8, 256))
    assert logits.dtype == torch.bfloat16
    assert torch.isfinite(logits.float()).all()


@pytest.mark.parametrize(
    ("name", "expected"),
    [("llama_1b", 1.24e9), ("llama_8b", 8.03e9), ("llama_70b", 70.6e9)],
)
def test_preset_param_counts_on_meta(name: str, expected: float) -> None:
    model = build_llama(preset(name))
    assert all(p.is_meta for p in model.parameters())
    total = num_params(model)
    assert abs(total - expected) / expected < 0.02
    assert total == count_params(preset(name))


def test_tied_head_shares_embedding_and_survives_to_empty() -> None:
    model = build_llama(preset("llama_1b"))
    assert model.output.weight is model.tok_embeddings.weight
    tiny_tied = build_llama(dataclasses.replace(preset("tiny"), tie_embeddings=True))
    tiny_tied.to_empty(device="cpu")
    assert tiny_tied.output.weight is tiny_tied.tok_embeddings.weight
    names = [name for name, _ in tiny_tied.named_parameters()]
    assert "tok_embeddings.weight" in names and "output.weight" not in names


def test_num_params_exclude_embeddings() -> None:
    untied = build_llama(preset("llama_8b"))
    embed = preset("llama_8b").vocab_size * preset("llama_8b").dim
    assert num_params(untied, exclude_embeddings=True) == num_params(untied) - embed
    # A tied table is the head, so excluding embeddings removes nothing.
    tied = build_llama(preset("llama_1b"))
    assert num_params(tied, exclude_embeddings=True) == num_params(tied)


def test_flops_per_token_formula() -> None:
    args = preset("llama_8b")
    n = num_params(build_llama(args), exclude_embeddings=True)
    expected = 6 * n + 12 * args.n_layers * args.dim * 4096
    assert flops_per_token(args, 4096) == pytest.approx(expected)
    # Tied 1B: head counted once, embedding not again.
    args_1b = preset("llama_1b")
    n_1b = num_params(build_llama(args_1b))
    expected_1b = 6 * n_1b + 12 * args_1b.n_layers * args_1b.dim
    assert flops_per_token(args_1b, 1) == pytest.approx(expected_1b)


def test_gqa_matches_repeated_kv_reference() -> None:
    model = tiny_model()
    attention = model.layers[0].attention
    assert attention.n_kv_heads < attention.n_heads
    x = torch.randn(2, 12, model.args.dim, generator=torch.Generator().manual_seed(1))
    rope = rope_cos_sin(model.args.head_dim, 12, model.args.rope_theta, x.device)

    batch, seq_len, _ = x.shape
    head_dim = model.args.head_dim
    q = apply_rope(attention.wq(x).view(batch, seq_len, -1, head_dim), rope).transpose(1, 2)
    k = apply_rope(attention.wk(x).view(batch, seq_len, -1, head_dim), rope).transpose(1, 2)
    v = attention.wv(x).view(batch, seq_len, -1, head_dim).transpose(1, 2)
    group = attention.n_heads // attention.n_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    reference = attention.wo((weights @ v).transpose(1, 2).reshape(batch, seq_len, -1))

    torch.testing.assert_close(attention(x, rope), reference, rtol=1e-5, atol=1e-5)


def test_causality() -> None:
    model = tiny_model().eval()
    tokens = random_tokens(1, 20, 256)
    changed = tokens.clone()
    t = 11
    changed[0, t] = (tokens[0, t] + 1) % 256
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :t], after[:, :t], rtol=0, atol=0)
    assert not torch.allclose(before[:, t:], after[:, t:])


def test_rope_matches_complex_reference() -> None:
    head_dim, seq_len, theta = 16, 10, 10000.0
    x = torch.randn(2, seq_len, 3, head_dim, generator=torch.Generator().manual_seed(2))
    rope = rope_cos_sin(head_dim, seq_len, theta, x.device)

    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freqs)
    rotation = torch.polar(torch.ones_like(angles), angles).view(1, seq_len, 1, -1)
    as_complex = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    reference = torch.view_as_real(as_complex * rotation).flatten(-2).float()

    torch.testing.assert_close(apply_rope(x, rope), reference, rtol=1e-5, atol=1e-5)


def test_rope_score_depends_only_on_relative_position() -> None:
    head_dim, theta = 32, 10000.0
    rope = rope_cos_sin(head_dim, 64, theta, torch.device("cpu"))
    generator = torch.Generator().manual_seed(3)
    q_vec = torch.randn(head_dim, generator=generator)
    k_vec = torch.randn(head_dim, generator=generator)
    # The same q and k vector placed at every position.
    q = apply_rope(q_vec.expand(1, 64, 1, head_dim), rope)[0, :, 0]
    k = apply_rope(k_vec.expand(1, 64, 1, head_dim), rope)[0, :, 0]

    def score(m: int, n: int) -> torch.Tensor:
        return q[m] @ k[n]

    for offset in (0, 3, 17):
        reference = score(offset, 0)
        for shift in (5, 20, 40):
            shifted = score(offset + shift, shift)
            torch.testing.assert_close(shifted, reference, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(score(3, 0), score(0, 0))


def test_init_is_bitwise_reproducible() -> None:
    first, second = tiny_model(), tiny_model()
    for (name, a), (_, b) in zip(first.named_parameters(), second.named_parameters()):
        assert torch.equal(a, b), name
    other_seed = build_llama(preset("tiny"), device="cpu")
    init_params(other_seed, seed=1)
    wq_other = other_seed.layers[0].attention.wq.weight
    assert not torch.equal(wq_other, first.layers[0].attention.wq.weight)


def test_init_param_deterministic_and_device_dtype_independent() -> None:
    model = build_llama(preset("tiny"))
    name = "layers.1.feed_forward.w1.weight"
    shape = (model.args.ffn_hidden, model.args.dim)

    def fill(dtype: torch.dtype) -> torch.Tensor:
        full = torch.empty(shape, dtype=dtype)
        model.init_param(name, full, torch.Generator().manual_seed(param_seed(7, name)))
        return full

    assert torch.equal(fill(torch.float32), fill(torch.float32))
    # A lower-precision target gets the same samples, only rounded.
    assert torch.equal(fill(torch.bfloat16), fill(torch.float32).to(torch.bfloat16))


def test_init_stds_and_norms() -> None:
    args = dataclasses.replace(preset("tiny"), vocab_size=1024)
    model = build_llama(args, device="cpu")
    init_params(model, seed=0)
    residual = 0.02 / math.sqrt(2 * args.n_layers)
    expected = {
        "tok_embeddings.weight": 0.02,
        "output.weight": args.dim**-0.5,
        "layers.0.attention.wq.weight": 0.02,
        "layers.2.attention.wk.weight": 0.02,
        "layers.1.feed_forward.w3.weight": 0.02,
        "layers.3.attention.wo.weight": residual,
        "layers.0.feed_forward.w2.weight": residual,
    }
    params = dict(model.named_parameters())
    for name, std in expected.items():
        assert params[name].std().item() == pytest.approx(std, rel=0.05), name
        assert abs(params[name].mean().item()) < 0.1 * std, name
    for name, param in params.items():
        if name.endswith("norm.weight"):
            assert torch.equal(param, torch.ones_like(param)), name


def test_init_param_rejects_unknown_names_and_shards() -> None:
    model = build_llama(preset("tiny"))
    generator = torch.Generator().manual_seed(0)
    for bad in ("layers.4.attention.wq.weight", "layers.0.attention.bias", "head.weight"):
        with pytest.raises(KeyError):
            model.init_param(bad, torch.empty(1), generator)
    with pytest.raises(ValueError, match="full tensor"):
        model.init_param("output.weight", torch.empty(128, 128), generator)


def test_param_seed_is_stable_and_distinct() -> None:
    assert param_seed(0, "norm.weight") == param_seed(0, "norm.weight")
    assert param_seed(0, "norm.weight") != param_seed(1, "norm.weight")
    layer0, layer1 = "layers.0.attention.wq.weight", "layers.1.attention.wq.weight"
    assert param_seed(0, layer0) != param_seed(0, layer1)
    assert 0 <= param_seed(123, "norm.weight") < 2**63


def test_dropout_train_vs_eval() -> None:
    model = tiny_model(dropout=0.2)
    tokens = random_tokens(2, 16, 256)
    model.train()
    assert not torch.equal(model(tokens), model(tokens))
    torch.manual_seed(42)
    first = model(tokens)
    torch.manual_seed(42)
    assert torch.equal(first, model(tokens))
    model.eval()
    assert torch.equal(model(tokens), model(tokens))


def test_blocks_take_hidden_and_rope_positionally() -> None:
    model = tiny_model().eval()
    tokens = random_tokens(1, 8, 256)
    hidden = model.tok_embeddings(tokens)
    rope = rope_cos_sin(model.args.head_dim, 8, model.args.rope_theta, hidden.device)
    for block in model.layers:
        hidden = block(hidden, rope)
    torch.testing.assert_close(model.output(model.norm(hidden)), model(tokens), rtol=0, atol=0)
    assert not list(model.buffers())


def test_seq_len_over_max_raises() -> None:
    model = tiny_model()
    too_long = torch.zeros(1, model.args.max_seq_len + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="data.seq_len"):
        model(too_long)


def test_invalid_args_rejected() -> None:
    with pytest.raises(ValueError):
        LlamaArgs(
            dim=128, n_layers=1, n_heads=4, n_kv_heads=3,
            vocab_size=8, ffn_hidden=8, max_seq_len=8,
        )


def test_backward_reaches_every_parameter() -> None:
    model = tiny_model()
    logits = model(random_tokens(2, 8, 256))
    F.cross_entropy(logits.flatten(0, 1), random_tokens(2, 8, 256, seed=1).flatten()).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
