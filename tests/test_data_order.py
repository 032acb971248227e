"""An epoch's order, held a part at a time (trainer/data/tokens.py), is numpy's whole permutation."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.data import tokens as data


@pytest.mark.parametrize("num_windows", [3, 65_536, 200_003, 5_000_001])
def test_the_order_held_a_part_at_a_time_is_the_whole_permutation(num_windows):
    """windows_of reads an epoch's order in parts (redrawn per part, a few held): the windows
    are numpy's permutation(num_windows) at every position, across part and epoch boundaries,
    and what the run holds is a few parts, not the corpus's length."""
    data._order_part.cache_clear()
    size = data.order_part_size(num_windows)
    whole = [np.random.default_rng([7, e]).permutation(num_windows) for e in range(5)]
    rng = np.random.default_rng(0)
    edges = [0, size - 2, 2 * size - 3, num_windows - 5]  # straddle parts and the epoch's end
    for first in [e for e in edges if 0 <= e < num_windows] + list(rng.integers(0, num_windows, 3)):
        samples = np.arange(first, first + 9, dtype=np.int64)
        got = data.windows_of(samples, num_windows, seed=7)
        want = [whole[g // num_windows][g % num_windows] for g in samples]
        assert got.tolist() == [int(w) for w in want]
    # What a run holds: at most four parts (the cache's size), each a part's entries, int32.
    assert data._order_part.cache_info().currsize <= 4
    part = data._order_part(7, 0, num_windows, 0)
    assert part.dtype == np.int32 and len(part) == min(size, num_windows)
    if num_windows > 4 * data.ORDER_PART_MIN:
        assert 4 * part.nbytes < num_windows * 4
    if num_windows > 4_000_000:
        assert size == -(-num_windows // 64)  # a 64th of the epoch a part on a large corpus
