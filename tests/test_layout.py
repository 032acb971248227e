"""The parallel layout (sharding/layout.py) on its own, without torch or a process group: how
fsdp and hsdp worlds split into replicas, shards and sequence groups, the global batch it counts,
what `auto` leaves pending and the new layout it makes, and each refusal's one line."""

from __future__ import annotations

import itertools

import pytest

from sharding.layout import AUTO, LayoutError, auto_degrees, make_layout, mesh_layout


@pytest.mark.parametrize("mode, world, replicate, sequence",
                         [(m, w, r, s) for m, w, r, s in itertools.product(
                             ("fsdp", "hsdp"), (1, 2, 4, 8), (1, 2), (1, 2, 4))
                          if (m == "hsdp" or r == 1) and w % r == 0 and (w // r) % s == 0])
def test_every_rank_has_one_place(mode, world, replicate, sequence) -> None:
    layout = make_layout(mode, world, replicate if mode == "hsdp" else None, sequence, 2, 3, None)
    assert layout.shard == world // replicate
    assert layout.data_size == world // sequence
    places = {(layout.data_rank(r), layout.sequence_rank(r)) for r in range(world)}
    assert len(places) == world  # each (share, slice) read by exactly one rank
    # A sequence group is adjacent ranks: they share a share of the batch, in slice order.
    for r in range(world):
        first = r - layout.sequence_rank(r)
        assert [layout.data_rank(first + i) for i in range(sequence)] == [layout.data_rank(r)] * sequence
    assert layout.global_batch_size == 2 * 3 * (world // sequence)  # samples, each once


def test_the_global_batch_sets_the_accumulation_per_sequence_group() -> None:
    layout = make_layout("fsdp", 4, None, 2, 2, 1, 8)
    assert (layout.data_size, layout.grad_accum, layout.global_batch_size) == (2, 2, 8)
    assert make_layout("fsdp", 4, None, 1, 2, 1, 8).grad_accum == 1
    assert make_layout("none", 4, None, 1, 1, 5, None).shard == 1


def test_auto_leaves_the_split_pending_until_it_makes_a_new_layout() -> None:
    pending = make_layout("fsdp", 4, None, AUTO, AUTO, 1, 8)
    assert pending.pending == ("sharding.sequence", "train.micro_batch_size")
    assert pending.grad_accum == 2  # counted at micro-batch 1 and degree 1 for now
    for read in (lambda: pending.data_size, lambda: pending.data_rank(1),
                 lambda: pending.sequence_rank(1), lambda: pending.readers()):
        with pytest.raises(LayoutError, match="^sharding.sequence: auto is chosen"):
            read()
    assert auto_degrees(pending, seq_len=6) == [1, 2]  # 4 does not divide 6
    decided = pending.decided(sequence=2, micro_batch=2)
    assert decided is not pending and pending.sequence == AUTO  # a new value, the old kept
    assert (decided.pending, decided.data_size, decided.grad_accum,
            decided.global_batch_size) == ((), 2, 2, 8)
    assert auto_degrees(decided, seq_len=6) == [2]
    kept = make_layout("hsdp", 4, 2, AUTO, 1, 3, None).decided(sequence=2, micro_batch=1)
    assert (kept.replicate, kept.grad_accum, kept.data_size) == (2, 3, 2)
    with pytest.raises(LayoutError, match="^train.micro_batch_size: auto is chosen"):
        make_layout("fsdp", 2, None, 1, AUTO, 1, 4).micro_batch_size


@pytest.mark.parametrize("args, says", [
    (("fsdp", 2, 2, 1, 1, 1, None), r"sharding.replicate: only applies to sharding=hsdp \(now "
                                    r"sharding=fsdp\)"),
    (("hsdp", 4, 3, 1, 1, 1, None), "sharding.replicate: 3 does not divide the world size 4"),
    (("hsdp", 4, 0, 1, 1, 1, None), "sharding.replicate: must be a positive integer, got 0"),
    (("fsdp", 2, None, 0, 1, 1, None), "sharding.sequence: must be a positive integer or auto, "
                                       "got 0"),
    (("fsdp", 2, None, True, 1, 1, None), "sharding.sequence: must be a positive integer or "
                                          "auto, got True"),
    (("none", 2, None, 2, 1, 1, None), "sharding.sequence: 2 needs sharding=fsdp or hsdp"),
    (("fsdp", 6, None, 4, 1, 1, None), "sharding.sequence: sequence degree 4 must divide the "
                                       "world size 6"),
    (("hsdp", 8, 2, 8, 1, 1, None), "sharding.sequence: sequence degree 8 must divide the "
                                    "ranks per replica 4"),
    (("fsdp", 4, None, 2, 1, 2, 8), "train.grad_accum: set either train.grad_accum or "
                                    "train.global_batch_size, not both"),
    (("fsdp", 4, None, 2, 3, 1, 8), "train.global_batch_size: 8 is not divisible by "
                                    r"train.micro_batch_size x \(world size / "
                                    r"sharding.sequence=2\) = 3 x 2"),
    (("fsdp", 4, None, 1, 1, 1, 0), "train.global_batch_size: must be a positive integer"),
])
def test_each_refusal_is_one_line_naming_the_setting(args, says) -> None:
    with pytest.raises(LayoutError, match="^" + says) as caught:
        make_layout(*args)
    assert "\n" not in str(caught.value) and str(caught.value).startswith(caught.value.key)


def test_the_models_check_of_a_degree_comes_before_the_worlds() -> None:
    def heads(degree: int) -> None:
        raise LayoutError("sharding.sequence", f"{degree} must divide the attention heads 4")

    with pytest.raises(LayoutError, match="must divide the attention heads"):
        make_layout("fsdp", 1, None, 3, 1, 1, None, check_degree=heads)
    make_layout("fsdp", 2, None, 1, 1, 1, None, check_degree=heads)  # degree 1: not asked


def test_a_mesh_layout_and_its_readers_line() -> None:
    assert mesh_layout("fsdp", 2).readers() == "ranks 2"
    assert mesh_layout("hsdp", 4, 2, sequence=2).readers() == (
        "sequence groups 2 of 2 ranks, each rank 1/2 of every sample's tokens")
