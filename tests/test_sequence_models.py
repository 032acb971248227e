"""Sequence parallelism inside the models (trainer/models/sequence_parallel.py): over 2 gloo
ranks sharing each sample, the loss summed over the ranks' slices equals the whole-sequence
summed loss, and the parameter gradients summed over the group equal the whole-sequence ones,
for the built-in Llama (MHA, GQA, GQA with repeated KV heads, packed documents crossing the
slice boundary, plain and chunked head) and an unmodified HF Llama (sdpa and eager, KV heads
repeated where the group does not divide them).

One 2-rank spawn runs every case (processes are the slow part here); each test reads its case.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from sharding.sequence import sequence_slice
from tests.dist import spawn
from tests.helpers import config
from trainer.config import ConfigError
from trainer.models.families import family_named
from trainer.models.llama import LlamaArgs, build_llama, next_token_loss_sum
from trainer.models.qwen3 import build_qwen3

BATCH, SEQ, VOCAB, CHUNK = 2, 16, 64, 5
# Row 0: documents of 5, 7 and 4 tokens (the 7 crosses the boundary between the two slices at
# 8); row 1: 10 and 6 tokens.
POSITIONS = torch.tensor([list(range(5)) + list(range(7)) + list(range(4)),
                          list(range(10)) + list(range(6))])
# name: (arch, query heads, kv heads, packed, chunked head, HF attention implementation)
CASES = {"llama_mha": ("llama", 4, 4, False, False, None),
         "llama_gqa_packed": ("llama", 4, 2, True, False, None),
         "llama_gqa_chunked": ("llama", 4, 2, False, True, None),
         "llama_mqa_repeated_packed_chunked": ("llama", 4, 1, True, True, None),
         "qwen3_gqa_packed_chunked": ("qwen3", 4, 2, True, True, None),
         "hf_sdpa": ("hf", 4, 2, False, False, "sdpa"),
         "hf_sdpa_packed_chunked": ("hf", 4, 2, True, True, "sdpa"),
         "hf_eager_packed": ("hf", 4, 2, True, False, "eager"),
         "hf_eager_chunked": ("hf", 4, 4, False, True, "eager"),
         # KV heads the group does not divide: repeated before the split (issue 45, item 2)
         "hf_sdpa_mqa_repeated_packed": ("hf", 4, 1, True, False, "sdpa"),
         "hf_eager_mqa_repeated_chunked": ("hf", 4, 1, False, True, "eager")}


def _model(arch: str, heads: int, kv_heads: int, implementation: str | None):
    torch.manual_seed(0)  # both ranks and both copies: the same weights
    if arch in ("llama", "qwen3"):  # Qwen3: heads of 16 on a dim of 32, q/k norms
        build = build_llama if arch == "llama" else build_qwen3
        return build(LlamaArgs(dim=32, n_layers=2, n_heads=heads, n_kv_heads=kv_heads,
                               vocab_size=VOCAB, ffn_hidden=48, max_seq_len=SEQ,
                               head_width=None if arch == "llama" else 16), device="cpu")
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.models.hf import HFCausalLM

    hf_config = AutoConfig.for_model(
        "llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=SEQ,
        attention_dropout=0.0)
    hf_config._attn_implementation = implementation
    return HFCausalLM(AutoModelForCausalLM.from_config(hf_config))


def _loss(model, tokens, targets, positions, chunked: bool) -> torch.Tensor:
    if chunked:
        return model(tokens, positions=positions, targets=targets, chunk_tokens=CHUNK)
    logits = model(tokens) if positions is None else model(tokens, positions=positions)
    return next_token_loss_sum(logits, targets)


def _case(rank: int, world: int, arch: str, heads: int, kv_heads: int, packed: bool,
          chunked: bool, implementation: str | None) -> dict:
    generator = torch.Generator().manual_seed(heads * 10 + kv_heads)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    targets[:, ::3] = -100  # unsupervised targets on both slices
    positions = POSITIONS if packed else None

    whole = _model(arch, heads, kv_heads, implementation)
    expected = _loss(whole, tokens, targets, positions, chunked)
    expected.backward()

    model = _model(arch, heads, kv_heads, implementation)
    wrapped = family_named(arch).sequence_parallel(model, dist.group.WORLD)
    mine = [sequence_slice(t, rank, world) if t is not None else None
            for t in (tokens, targets, positions)]
    loss = _loss(model, *mine, chunked)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    worst = 0.0
    for (name, p), (_, q) in zip(model.named_parameters(), whole.named_parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)
        worst = max(worst, ((grad - q.grad).abs().max() / q.grad.abs().max()).item())
    return {"loss": total, "expected": expected.detach(), "grad_error": worst,
            "wrapped": wrapped}


def _all(rank: int, world: int) -> dict:
    return {name: _case(rank, world, *case) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    pytest.importorskip("transformers")
    return spawn(_all, 2)


@pytest.mark.parametrize("name", sorted(CASES))
def test_slices_give_the_whole_sequence_loss_and_gradients(results, name) -> None:
    for rank in results:
        got = rank[name]
        assert got["wrapped"] == 2  # one attention module per layer
        assert torch.allclose(got["loss"], got["expected"], rtol=1e-6, atol=0), name
        assert got["grad_error"] < 1e-6, (name, got["grad_error"])


def test_hf_attention_outside_the_registry_is_refused_naming_the_key() -> None:
    pytest.importorskip("transformers")
    hf = ("model.hf_config={model_type: llama, vocab_size: 64, hidden_size: 32, "
          "intermediate_size: 48, num_hidden_layers: 2, num_attention_heads: 4, "
          "num_key_value_heads: 2, max_position_embeddings: 16}")
    m = config("model=hf", hf, "model.attn_implementation=flex_attention").model
    with pytest.raises(ConfigError, match="^model.attn_implementation: 'flex_attention'"):
        family_named("hf").check_sequence_parallel(m)
    family_named("hf").check_sequence_parallel(config("model=hf", hf).model)  # sdpa: accepted
    with pytest.raises(ConfigError, match="^sharding.sequence: model.arch=vit"):
        family_named("vit").check_sequence_parallel(config("model=vit_tiny").model)
