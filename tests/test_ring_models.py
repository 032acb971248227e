"""Ring attention inside the built-in models (sharding.context, trainer/models/sequence_parallel.py's
ring_wrap): the loss summed over the ranks' shares equals the whole-sequence summed loss, and the
parameter gradients summed over the ranks equal the whole-sequence ones (1e-5: the softmax merge
reorders sums), for context=2 on 2 gloo ranks and sequence=2 x context=2 on 4 (Ulysses inside
the ring): MHA, GQA, MQA, packed documents crossing chunk and rank borders, the plain and the
chunked head, Qwen3.

One spawn per world size runs every case; each test reads its case.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from sharding.ring import sample_slice
from tests.dist import spawn
from tests.test_sequence_models import _model
from trainer.models.families import family_named
from trainer.models.llama import next_token_loss_sum

BATCH, SEQ, VOCAB, CHUNK = 2, 16, 64, 5
TOLERANCE = 1e-5
# Row 0: documents of 5, 7 and 4 tokens; row 1: 3, 10 and 3 (both cross the 2M and 2NM chunk
# borders, so documents span ring places and Ulysses slices).
POSITIONS = torch.tensor([list(range(5)) + list(range(7)) + list(range(4)),
                          list(range(3)) + list(range(10)) + list(range(3))])
# name: (arch, query heads, kv heads, packed, chunked head, HF attention implementation)
CASES = {"llama_mha": ("llama", 4, 4, False, False, None),
         "llama_gqa_packed": ("llama", 4, 2, True, False, None),
         "llama_mqa_chunked": ("llama", 4, 1, False, True, None),
         "llama_mqa_packed_chunked": ("llama", 4, 1, True, True, None),
         "qwen3_gqa_packed_chunked": ("qwen3", 4, 2, True, True, None),
         "hf_sdpa": ("hf", 4, 2, False, False, "sdpa"),
         "hf_sdpa_packed_chunked": ("hf", 4, 2, True, True, "sdpa"),
         "hf_eager_mqa_packed": ("hf", 4, 1, True, False, "eager")}


def _loss(model, tokens, targets, positions, chunked: bool) -> torch.Tensor:
    if chunked:
        return model(tokens, positions=positions, targets=targets, chunk_tokens=CHUNK)
    logits = model(tokens) if positions is None else model(tokens, positions=positions)
    return next_token_loss_sum(logits, targets)


def _groups(rank: int, sequence: int, context: int):
    """(sequence group or None, ring, place) as the layout places ranks: rank = c * N + s."""
    world = sequence * context
    seq_groups = [dist.new_group([c * sequence + s for s in range(sequence)])
                  for c in range(context)] if sequence > 1 else None
    rings = [dist.new_group([c * sequence + s for c in range(context)])
             for s in range(sequence)] if sequence > 1 else [dist.group.WORLD]
    assert world == dist.get_world_size()
    c, s = rank // sequence, rank % sequence
    return (seq_groups[c] if seq_groups else None), rings[s], (c, context, s, sequence)


def _case(rank: int, sequence: int, context: int, arch: str, heads: int, kv_heads: int,
          packed: bool, chunked: bool, implementation: str | None) -> dict:
    generator = torch.Generator().manual_seed(heads * 10 + kv_heads)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    targets[:, ::3] = -100  # unsupervised targets on every share
    positions = POSITIONS if packed else None

    whole = _model(arch, heads, kv_heads, implementation)
    expected = _loss(whole, tokens, targets, positions, chunked)
    expected.backward()

    model = _model(arch, heads, kv_heads, implementation)
    group, ring, place = _groups(rank, sequence, context)
    wrapped = family_named(arch).sequence_parallel(model, group, ring)
    mine = [sample_slice(t, *place) if t is not None else None
            for t in (tokens, targets, positions)]
    loss = _loss(model, *mine, chunked)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    worst = 0.0
    for p, q in zip(model.parameters(), whole.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)
        worst = max(worst, ((grad - q.grad).abs().max() / q.grad.abs().max()).item())
    return {"loss": total, "expected": expected.detach(), "grad_error": worst,
            "wrapped": wrapped, "share": tuple(mine[0].shape)}


def _mesh(rank: int, world: int, sequence: int) -> dict:
    """The run's mesh (sharding/sequence.py) for this layout: which ranks it groups."""
    from sharding.layout import mesh_layout
    from sharding.sequence import build_sequence_mesh

    seq = build_sequence_mesh(mesh_layout("fsdp", world, sequence=sequence,
                                          context=world // sequence), "cpu")
    return {"sequence": dist.get_process_group_ranks(seq.group),
            "ring": dist.get_process_group_ranks(seq.context_group),
            "place": (seq.context_rank, seq.rank), "dims": seq.mesh.mesh_dim_names,
            "fsdp": seq.fsdp.mesh.tolist()}


def _all(rank: int, world: int, sequence: int, names: tuple) -> dict:
    results = {name: _case(rank, sequence, world // sequence, *CASES[name]) for name in names}
    results["mesh"] = _mesh(rank, world, sequence)
    return results


@pytest.fixture(scope="module")
def context_2() -> list[dict]:
    pytest.importorskip("transformers")
    return spawn(_all, 2, 1, tuple(CASES))


@pytest.mark.parametrize("name", sorted(CASES))
def test_context_2_gives_the_whole_sequence_loss_and_gradients(context_2, name) -> None:
    for rank in context_2:
        got = rank[name]
        assert got["wrapped"] == 2  # one attention module per layer
        assert got["share"] == (BATCH, SEQ // 2)
        assert torch.allclose(got["loss"], got["expected"], rtol=TOLERANCE, atol=0), name
        assert got["grad_error"] < TOLERANCE, (name, got["grad_error"])


def test_sequence_2_by_context_2_gives_the_whole_sequence_loss_and_gradients() -> None:
    names = ("llama_gqa_packed", "llama_mqa_chunked", "qwen3_gqa_packed_chunked",
             "hf_sdpa_packed_chunked", "hf_eager_mqa_packed")
    ranks = spawn(_all, 4, 2, names)
    for place, rank in enumerate(ranks):  # Ulysses pairs adjacent, rings strided over them
        c, s = place // 2, place % 2
        assert rank["mesh"] == {"sequence": [2 * c, 2 * c + 1], "ring": [s, s + 2],
                                "place": (c, s), "dims": ("data", "context", "sequence"),
                                "fsdp": [0, 1, 2, 3]}
        for name in names:
            got = rank[name]
            assert got["share"] == (BATCH, SEQ // 4)
            assert torch.allclose(got["loss"], got["expected"], rtol=TOLERANCE, atol=0), name
            assert got["grad_error"] < TOLERANCE, (name, got["grad_error"])


def test_the_mesh_keeps_ulysses_inside_and_the_ring_across(context_2) -> None:
    for rank, got in enumerate(context_2):
        assert got["mesh"] == {"sequence": [rank], "ring": [0, 1], "place": (rank, 0),
                               "dims": ("data", "context", "sequence"), "fsdp": [0, 1]}

