"""Ulysses sequence parallelism (sharding/sequence.py): attention on sequence shards over 2 gloo
ranks equals plain causal SDPA on the whole sequence, forward and gradients; the all-to-all's
backward is its inverse; the mesh puts sequence ranks side by side.

One 2-rank spawn runs every case (processes are the slow part here); each test reads its case.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from sharding.layout import check_mesh_sizes, mesh_layout
from sharding.sequence import (all_to_all, build_sequence_mesh, check_degree, gather_sequence,
                               heads_to_sequence, kv_repeats, sequence_slice, sequence_to_heads,
                               ulysses_attention)
from tests.dist import spawn
from trainer.models.doc_attention import document_mask

BATCH, SEQ, HEAD_DIM = 2, 16, 8
# name: (query heads, kv heads, layout of the attention function's output, document mask,
#        value head size: another than HEAD_DIM sends v apart from q and k)
CASES = {"mha": (4, 4, "bhsd", False, HEAD_DIM), "gqa_kv2": (4, 2, "bhsd", False, HEAD_DIM),
         "mqa_kv1_repeated": (4, 1, "bhsd", False, HEAD_DIM),
         "document_mask": (4, 2, "bhsd", True, HEAD_DIM),
         "out_layout_bshd": (4, 2, "bshd", False, HEAD_DIM),
         "value_head_size_differs": (4, 2, "bhsd", False, 4)}
# Documents of 5, 7 and 4 tokens: the second crosses the boundary between the two ranks' chunks.
POSITIONS = torch.tensor([list(range(5)) + list(range(7)) + list(range(4))] * BATCH)


def _attention(out_layout: str):
    def attend(q, k, v, **kwargs):
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        return out.transpose(1, 2) if out_layout == "bshd" else out
    return attend


def _case(rank: int, world: int, q_heads: int, kv_heads: int, out_layout: str,
          masked: bool, v_dim: int) -> dict:
    generator = torch.Generator().manual_seed(q_heads * 10 + kv_heads)
    q, k, v = (torch.randn(BATCH, h, SEQ, size, generator=generator)
               for h, size in ((q_heads, HEAD_DIM), (kv_heads, HEAD_DIM), (kv_heads, v_dim)))
    grad_out = torch.randn(BATCH, q_heads, SEQ, v_dim, generator=generator)
    mask = document_mask(POSITIONS, "sdpa") if masked else None
    kwargs = {"attn_mask": mask} if masked else {"is_causal": True}
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*whole, enable_gqa=True, **kwargs)
    expected.backward(grad_out)

    local = [sequence_slice(t, rank, world, dim=2).clone().requires_grad_() for t in (q, k, v)]
    if masked:  # each rank holds only its positions; the mask needs the whole sequence's
        mine = sequence_slice(POSITIONS, rank, world, dim=1)
        kwargs = {"attn_mask": document_mask(gather_sequence(mine, dist.group.WORLD), "sdpa")}
    out = ulysses_attention(_attention(out_layout), *local, dist.group.WORLD,
                            out_layout=out_layout, enable_gqa=True, **kwargs)
    if out_layout == "bshd":
        out = out.transpose(1, 2)
    out.backward(sequence_slice(grad_out, rank, world, dim=2))
    mine = [sequence_slice(t, rank, world, dim=2) for t in (expected, *(w.grad for w in whole))]
    return {"got": [out.detach(), *(t.grad for t in local)], "expected": mine}


def _inverse(rank: int, world: int) -> dict:
    """x -> all_to_all (scatter heads, gather sequence); its gradient against the opposite
    all-to-all of the upstream gradient, and the contents against the whole tensor."""
    generator = torch.Generator().manual_seed(7)
    whole = torch.randn(BATCH, SEQ, 4, HEAD_DIM, generator=generator)  # [B, T, H, D]
    upstream = torch.randn(BATCH, SEQ, 2, HEAD_DIM, generator=generator)
    x = sequence_slice(whole, rank, world, dim=1).clone().requires_grad_()
    y = sequence_to_heads(x, dist.group.WORLD)
    y.backward(upstream)
    inverse = heads_to_sequence(upstream, dist.group.WORLD)
    return {"shape": tuple(y.shape), "heads": torch.equal(y, whole[:, :, 2 * rank:2 * rank + 2]),
            "grad_is_inverse": torch.equal(x.grad, inverse),
            "round_trip": torch.equal(heads_to_sequence(y.detach(), dist.group.WORLD), x.detach()),
            "generic_dims": torch.equal(all_to_all(x.detach(), dist.group.WORLD, 2, 1),
                                        y.detach())}


def _mesh(rank: int, world: int) -> dict:
    layout = mesh_layout("fsdp", world, sequence=world)
    seq = build_sequence_mesh(layout, "cpu")
    return {"group": dist.get_process_group_ranks(seq.group), "rank": seq.rank,
            "data": (layout.data_rank(rank), layout.data_size), "fsdp": seq.fsdp.mesh.tolist(),
            "fsdp_dims": seq.fsdp.mesh_dim_names, "dims": seq.mesh.mesh_dim_names}


def _all_cases(rank: int, world: int) -> dict:
    results = {name: _case(rank, world, *spec) for name, spec in CASES.items()}
    results["inverse"] = _inverse(rank, world)
    results["mesh"] = _mesh(rank, world)
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return spawn(_all_cases, 2)


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


@pytest.mark.parametrize("case", sorted(CASES))
def test_ulysses_attention_equals_whole_sequence_attention(ranks, case) -> None:
    for result in (r[case] for r in ranks):
        for what, got, expected in zip(("out", "dq", "dk", "dv"), result["got"],
                                       result["expected"], strict=True):
            assert got.shape == expected.shape, what
            assert _relative(got, expected) <= 1e-6, (what, _relative(got, expected))


def test_bitwise_where_the_order_of_sums_is_the_same(ranks) -> None:
    """Per head, attention over the whole sequence is the same arithmetic on 1 rank or 2, so all
    is bitwise, except the gradient of a repeated KV head: its copies are summed after the
    all-to-all instead of inside one attention kernel (within 1e-6, tested above)."""
    for case in CASES:
        for result in (r[case] for r in ranks):
            equal = [torch.equal(a, b) for a, b in zip(result["got"], result["expected"])]
            assert equal[:2] == [True, True] and (case == "mqa_kv1_repeated" or all(equal))


def test_all_to_all_backward_is_its_inverse(ranks) -> None:
    for result in ranks:
        assert result["inverse"] == {"shape": (BATCH, SEQ, 2, HEAD_DIM), "heads": True,
                                     "grad_is_inverse": True, "round_trip": True,
                                     "generic_dims": True}


def test_sequence_ranks_are_adjacent_and_fsdp_spans_them(ranks) -> None:
    for rank, result in enumerate(ranks):
        assert result["mesh"] == {"group": [0, 1], "rank": rank, "data": (0, 1),
                                  "fsdp": [0, 1], "fsdp_dims": ("shard",),
                                  "dims": ("data", "sequence")}


# --- pure checks ---------------------------------------------------------------------------

@pytest.mark.parametrize("q_heads,kv_heads,degree,repeats", [
    (4, 4, 2, 1), (4, 2, 2, 1), (4, 1, 2, 2), (8, 2, 8, 4), (12, 6, 4, 2), (32, 8, 8, 1),
    (64, 8, 16, 2), (8, 1, 8, 8)])
def test_kv_repeats_keep_each_query_head_on_its_own_kv_head(q_heads, kv_heads, degree,
                                                            repeats) -> None:
    assert kv_repeats(q_heads, kv_heads, degree) == repeats
    # Rank r's query heads and repeated KV heads, as ulysses_attention splits them.
    kv_ids = torch.arange(kv_heads).repeat_interleave(repeats).chunk(degree)
    q_ids = torch.arange(q_heads).chunk(degree)
    for q_local, kv_local in zip(q_ids, kv_ids):
        group = len(q_local) // len(kv_local)  # enable_gqa's grouping on the rank
        owners = kv_local[torch.arange(len(q_local)) // group]
        assert torch.equal(owners, q_local // (q_heads // kv_heads))


@pytest.mark.parametrize("q_heads,kv_heads,degree,message", [
    (6, 2, 4, "sequence degree 4 must divide the attention heads 6"),
    (4, 3, 2, "must be a multiple of the KV heads 3"), (4, 4, 0, "must be >= 1")])
def test_kv_repeats_refuse_what_cannot_split(q_heads, kv_heads, degree, message) -> None:
    with pytest.raises(ValueError, match=message):
        kv_repeats(q_heads, kv_heads, degree)


def test_sequence_slice_and_sizes() -> None:
    x = torch.arange(12).reshape(1, 12)
    assert sequence_slice(x, 2, 3).tolist() == [[8, 9, 10, 11]]
    with pytest.raises(ValueError, match="must divide the sequence length 12"):
        sequence_slice(x, 0, 5)
    with pytest.raises(ValueError, match="rank 3 is not in a sequence group of 3"):
        sequence_slice(x, 3, 3)
    check_degree(8, 4)
    check_mesh_sizes("hsdp", 8, 2, 4)
    for args, message in [(("none", 2, 1, 2), "needs sharding fsdp or hsdp"),
                          (("fsdp", 6, 1, 4), "must divide the world size 6"),
                          (("hsdp", 8, 2, 8), "must divide the ranks per replica 4")]:
        with pytest.raises(ValueError, match=message):
            check_mesh_sizes(*args)


def _hsdp_mesh(rank: int, world: int) -> dict:
    layout = mesh_layout("hsdp", world, 2, sequence=2)
    seq = build_sequence_mesh(layout, "cpu")
    total = torch.tensor([rank])
    dist.all_reduce(total, group=seq.group)  # the group works: the sum of its two ranks
    return {"group": dist.get_process_group_ranks(seq.group), "sum": total.item(),
            "data": (layout.data_rank(rank), layout.data_size), "fsdp": seq.fsdp.mesh.tolist(),
            "fsdp_dims": seq.fsdp.mesh_dim_names, "dims": seq.mesh.mesh_dim_names}


def test_hsdp_mesh_on_four_ranks() -> None:
    for rank, result in enumerate(spawn(_hsdp_mesh, 4)):
        pair = [rank // 2 * 2, rank // 2 * 2 + 1]
        assert result == {"group": pair, "sum": sum(pair), "data": (rank // 2, 2),
                          "fsdp": [[0, 1], [2, 3]], "fsdp_dims": ("replicate", "shard"),
                          "dims": ("replicate", "data", "sequence")}
