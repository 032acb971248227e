"""Packed sequences on the model side (issue 25): documents that share a window never see each
other, rotary positions follow `positions`, checkpointing keeps the packed gradients bit for bit.

Both causal LMs are checked: the built-in Llama (tiny shapes, grouped-query attention) and a
Hugging Face Llama built through `model=hf`. Every isolation test also shows that the same
window without positions does mix the documents, so the comparison can fail.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from checkpointing.meter import SavedBytesMeter
from tests.checkpoint_harness import train_steps
from tests.helpers import config, preset, layout_of
from trainer.build import build_model, build_on_meta, init_params, materialize
from trainer.distenv import read_env
from trainer.models.llama import (IGNORE_INDEX, build_llama, lm_loss, next_token_loss, rope_at,
                                  rope_cos_sin)
from trainer.models.doc_attention import choose_backend, document_ids, document_mask

HF_LLAMA = ("model.hf_config={model_type: llama, vocab_size: 256, hidden_size: 64, "
            "intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, "
            "num_key_value_heads: 2, max_position_embeddings: 128}")
ARCHS = ["llama", "hf"]
TIGHT = {"atol": 1e-5, "rtol": 1e-5}
FLEX_EAGER = "ignore:flex_attention called without torch.compile"


def tiny_llama(**overrides):
    model = build_llama(dataclasses.replace(preset("tiny"), **overrides), device="cpu")
    init_params(model, seed=0)
    return model.eval()


def hf_llama():
    pytest.importorskip("transformers")
    model = build_on_meta(config("model=hf", HF_LLAMA).model)
    materialize(model, torch.device("cpu"), seed=0)
    return model.eval()


def make(arch: str):
    return tiny_llama() if arch == "llama" else hf_llama()


def doc(length: int, seed: int, low: int = 0, high: int = 256) -> torch.Tensor:
    return torch.randint(low, high, (1, length), generator=torch.Generator().manual_seed(seed))


def pack(*docs: tuple[torch.Tensor, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One row from (tokens [1, n], first position) pairs: the tokens and their positions."""
    tokens = torch.cat([t for t, _ in docs], dim=1)
    positions = torch.cat([torch.arange(s, s + t.shape[1]) for t, s in docs]).unsqueeze(0)
    return tokens, positions


def test_document_ids_follow_transformers_rule() -> None:
    positions = torch.tensor([[37, 38, 39, 0, 1, 2, 0, 5, 6, 7],
                              [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])
    expected = torch.tensor([[0, 0, 0, 1, 1, 1, 2, 3, 3, 3], [0] * 10])
    assert torch.equal(document_ids(positions), expected)
    masking = pytest.importorskip("transformers.masking_utils")
    assert torch.equal(masking.find_packed_sequence_indices(positions), expected)


def test_sdpa_mask_is_causal_inside_each_document() -> None:
    mask = document_mask(torch.tensor([[3, 4, 0, 1, 2]]), "sdpa")
    allowed = {(0, 0), (1, 0), (1, 1), (2, 2), (3, 2), (3, 3), (4, 2), (4, 3), (4, 4)}
    expected = torch.tensor([[(q, k) in allowed for k in range(5)] for q in range(5)])
    assert mask.shape == (1, 1, 5, 5)
    assert torch.equal(mask[0, 0], expected)


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_documents_give_the_logits_of_each_run_alone(arch: str) -> None:
    model = make(arch)
    a, b, c, d = doc(23, 1), doc(41, 2), doc(50, 3), doc(14, 4)
    rows = [pack((a, 0), (b, 0)), pack((c, 0), (d, 0))]
    tokens, positions = (torch.cat(parts) for parts in zip(*rows))
    with torch.no_grad():
        packed = model(tokens, positions=positions)
        mixed = model(tokens)
        alone = [model(t) for t in (a, b, c, d)]
    torch.testing.assert_close(packed[0, :23], alone[0][0], **TIGHT)
    torch.testing.assert_close(packed[0, 23:], alone[1][0], **TIGHT)
    torch.testing.assert_close(packed[1, :50], alone[2][0], **TIGHT)
    torch.testing.assert_close(packed[1, 50:], alone[3][0], **TIGHT)
    # Without positions the second document attends to the first: the check above can fail.
    assert (mixed[0, 23:] - alone[1][0]).abs().max() > 1e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_positions_zero_to_t_give_exactly_the_unpacked_logits(arch: str) -> None:
    model = make(arch)
    tokens = torch.cat([doc(64, 5), doc(64, 6)])
    positions = torch.arange(64).expand(2, 64)
    with torch.no_grad():
        assert torch.equal(model(tokens, positions=positions), model(tokens))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tail_first", [True, False])
def test_a_document_continued_from_an_earlier_window(arch: str, tail_first: bool) -> None:
    """A window starting mid-document (positions 5, 6, ...) runs that part at its positions;
    after another document, a jump to position 5 still starts a new document."""
    model = make(arch)
    tail, b = doc(27, 7), doc(37, 8)
    parts = [(tail, 5), (b, 0)] if tail_first else [(b, 0), (tail, 5)]
    tokens, positions = pack(*parts)
    with torch.no_grad():
        packed = model(tokens, positions=positions)
        tail_alone = model(tail, positions=torch.arange(5, 32).unsqueeze(0))
        b_alone = model(b)
        mixed = model(tokens)
    tail_part, b_part = (packed[0, :27], packed[0, 27:]) if tail_first else \
        (packed[0, 37:], packed[0, :37])
    torch.testing.assert_close(tail_part, tail_alone[0], **TIGHT)
    torch.testing.assert_close(b_part, b_alone[0], **TIGHT)
    second = mixed[0, 27:] if tail_first else mixed[0, 37:]
    assert (second - (b_alone[0] if tail_first else tail_alone[0])).abs().max() > 1e-2


def test_rotary_tables_at_positions_are_those_of_the_table() -> None:
    cos, sin = rope_cos_sin(32, 69, 10000.0, torch.device("cpu"))
    at_cos, at_sin = rope_at(torch.arange(5, 69).expand(3, 64), 32, 10000.0)
    assert at_cos.shape == (3, 64, 16) and at_cos.dtype == torch.float32
    assert torch.equal(at_cos, cos[5:].expand(3, 64, 16))
    assert torch.equal(at_sin, sin[5:].expand(3, 64, 16))


def _embedding(model) -> torch.Tensor:
    if hasattr(model, "tok_embeddings"):
        return model.tok_embeddings.weight
    return model.hf.get_input_embeddings().weight


def _a_then_b_supervised_on_b():
    """A (tokens 0..127) then B (128..255); only B's next tokens are labels."""
    a, b = doc(23, 9, 0, 128), doc(41, 10, 128, 256)
    tokens, positions = pack((a, 0), (b, 0))
    targets = torch.full_like(tokens, IGNORE_INDEX)
    targets[0, 23:-1] = tokens[0, 24:]
    return tokens, targets, positions, a.unique()


@pytest.mark.parametrize("arch", ARCHS)
def test_gradients_flow_and_never_reach_the_other_document(arch: str) -> None:
    model = make(arch).train()
    tokens, targets, positions, a_ids = _a_then_b_supervised_on_b()
    lm_loss(model, tokens, targets, positions).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name
    # A is not supervised and B never attends to it: A's embedding rows get exactly nothing.
    assert torch.equal(_embedding(model).grad[a_ids], torch.zeros_like(_embedding(model)[a_ids]))
    model.zero_grad()
    lm_loss(model, tokens, targets).backward()  # unpacked: B attends to A
    assert _embedding(model).grad[a_ids].abs().sum() > 0


def test_ignored_targets_carry_no_loss() -> None:
    model = tiny_llama()
    tokens, targets, positions, _ = _a_then_b_supervised_on_b()
    with torch.no_grad():
        logits = model(tokens, positions=positions)
        loss = lm_loss(model, tokens, targets, positions)
    kept = next_token_loss(logits[:, 23:-1], targets[:, 23:-1])
    assert IGNORE_INDEX not in targets[:, 23:-1]
    torch.testing.assert_close(loss, kept, rtol=1e-6, atol=0)
    assert not torch.isclose(loss, next_token_loss(logits, targets.clamp(min=0)))


def _packed_batch(step: int, rank: int):
    """Seeded tokens in windows of 64 holding documents of 17, 30 and 17 tokens (the first a
    continuation from position 9); no label crosses a boundary."""
    tokens = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(step))
    positions = torch.cat([torch.arange(9, 26), torch.arange(30), torch.arange(17)])
    targets = torch.full_like(tokens, IGNORE_INDEX)
    for start, end in ((0, 17), (17, 47), (47, 64)):
        targets[:, start:end - 1] = tokens[:, start + 1:end]
    return tokens, targets, positions.expand(4, 64)


def _packed_steps(overrides: list[str]):
    cfg = config("data.seq_len=64", "train.micro_batch_size=4", "model.dropout=0.1",
                 "checkpointing.profile_repeats=1", *overrides)
    meter = SavedBytesMeter()
    torch.manual_seed(7)  # dropout masks: the same sequence for every policy
    built = build_model(cfg, read_env("cpu"), layout=layout_of(cfg), meter=meter)
    positions = _packed_batch(0, 0)[2]

    def packed_loss(model, inputs, targets):
        return lm_loss(model, inputs, targets, positions)

    losses, grads, _ = train_steps(built, meter, cfg.optim, 2, 0,
                                   make_batch=lambda s, r: _packed_batch(s, r)[:2],
                                   loss_fn=packed_loss)
    return losses, grads, [p.recompute for p in built.plan]


def test_checkpointing_keeps_packed_gradients_bitwise(world_of_one) -> None:
    reference_losses, reference_grads, _ = _packed_steps(["checkpointing=none"])
    for overrides in (["checkpointing=full"],
                      ["checkpointing=full", "offload=disk", "offload.min_bytes=0"]):
        losses, grads, plan = _packed_steps(overrides)
        assert any(r != "none" for r in plan), overrides
        assert torch.equal(losses, reference_losses), overrides
        assert grads.keys() == reference_grads.keys()
        for name, grad in grads.items():
            assert torch.equal(grad, reference_grads[name]), (overrides, name)


def test_meta_forward_with_positions_keeps_shapes() -> None:
    tokens = torch.zeros(2, 64, dtype=torch.long, device="meta")
    llama = build_llama(preset("tiny"), device="meta")
    assert llama(tokens, positions=tokens).shape == (2, 64, 256)
    pytest.importorskip("transformers")
    hf = build_on_meta(config("model=hf", HF_LLAMA).model)
    assert hf(tokens, positions=tokens).shape == (2, 64, 256)


def test_bad_positions_are_refused() -> None:
    model, tokens = tiny_llama(), doc(16, 0)
    with pytest.raises(ValueError, match="positions must have the tokens' shape"):
        model(tokens, positions=torch.arange(15).unsqueeze(0))
    with pytest.raises(ValueError, match="positions must be an integer tensor"):
        model(tokens, positions=torch.arange(16.0).unsqueeze(0))


def test_backend_choice() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert choose_backend("auto", cuda, dropout_active=False) == "flex"
    assert choose_backend("auto", cuda, dropout_active=True) == "sdpa"  # flex has no dropout
    assert choose_backend("auto", cpu, dropout_active=False) == "sdpa"
    assert choose_backend("flex", cpu, dropout_active=False) == "flex"
    with pytest.raises(ValueError, match="has no attention dropout"):
        choose_backend("flex", cuda, dropout_active=True)
    with pytest.raises(ValueError, match="use one of"):
        choose_backend("dense", cpu, dropout_active=False)


def _three_documents(batch: int, seq_len: int, device: str):
    tokens = torch.randint(0, 256, (batch, seq_len), generator=torch.Generator().manual_seed(11))
    cut1, cut2 = seq_len // 3, seq_len // 3 + seq_len // 2
    positions = torch.cat([torch.arange(7, 7 + cut1), torch.arange(cut2 - cut1),
                           torch.arange(seq_len - cut2)]).expand(batch, seq_len)
    return tokens.to(device), positions.to(device)


@pytest.mark.filterwarnings(FLEX_EAGER)
def test_flex_block_mask_gives_the_sdpa_mask_logits_on_cpu() -> None:
    """The FlexAttention path uncompiled (its reference maths): the block mask allows exactly
    the pairs the SDPA mask allows, heads grouped the same way."""
    model = tiny_llama()
    tokens, positions = _three_documents(2, 150, "cpu")  # 150: a partial last block of 128
    with torch.no_grad():
        sdpa = model(tokens, positions=positions)
        model.args.packed_attention = "flex"
        flex = model(tokens, positions=positions)
    torch.testing.assert_close(flex, sdpa, **TIGHT)


@pytest.mark.cuda
def test_flex_attention_on_cuda_matches_the_sdpa_mask_path_bf16() -> None:
    """Compiled FlexAttention against the SDPA mask path in bf16; both against fp32 SDPA."""
    model = build_llama(dataclasses.replace(preset("tiny"), max_seq_len=1024), device="cuda")
    init_params(model, seed=0)
    tokens, positions = _three_documents(2, 1000, "cuda")
    results = {}
    for backend, dtype in (("sdpa", torch.float32), ("sdpa", torch.bfloat16),
                           ("flex", torch.bfloat16)):
        model.to(dtype).zero_grad(set_to_none=True)
        model.args.packed_attention = backend
        logits = model(tokens, positions=positions)
        logits.float().square().mean().backward()
        grad = model.layers[0].attention.wq.weight.grad.float()
        results[backend, dtype] = (logits.detach().float(), grad)
    reference = results["sdpa", torch.float32]
    sdpa, flex = results["sdpa", torch.bfloat16], results["flex", torch.bfloat16]
    torch.testing.assert_close(flex[0], sdpa[0], atol=5e-2, rtol=5e-2)
    for i in range(2):  # flex is no further from fp32 than bf16 SDPA is (with some slack)
        flex_error = (flex[i] - reference[i]).abs().max()
        sdpa_error = (sdpa[i] - reference[i]).abs().max()
        assert flex_error <= 2 * sdpa_error + 1e-3 * reference[i].abs().max(), i
