"""Tokenized documents (a `datasets.Dataset` with `ids` and `sup` list columns) read back for
packing as numpy slices of their Arrow columns, and their other columns read whole.

Reading them by `datasets`' row access made Python lists of every token and then numpy arrays
of those lists, one query per window: 2.2 s of the 26 s that 20,000 conversations took to
prepare (2026-12-05). Here many windows' documents come from one Arrow take, and each document
is a view into its flattened column, with no Python object per token.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from trainer.data.packing import Doc
BINS_AT_ONCE = 256  # windows whose documents one take reads: bounds the memory it holds


def column(docs, name: str) -> np.ndarray:
    """One column of scalars (`length`, `usable`) as numpy, read through Arrow. `docs[name]` is
    a lazy column that numpy reads a row at a time: 1.7 s for 100,000 rows (datasets 5.2)."""
    return docs.with_format("arrow")[name].to_numpy()


def listed(docs, name: str) -> list:
    """A column of lists (`bad`) as Python lists, read through Arrow."""
    return docs.with_format("arrow")[name].to_pylist()


def _flat(table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, supervised, offsets) of a pyarrow Table's rows: document k is [offsets[k],
    offsets[k + 1]) of the first two."""
    ids = table.column("ids").combine_chunks()
    sup = table.column("sup").combine_chunks()
    offsets = ids.offsets.to_numpy()
    if not np.array_equal(sup.offsets.to_numpy() - sup.offsets[0].as_py(),
                          offsets - offsets[0]):
        raise RuntimeError("tokenized documents whose ids and supervised flags differ in length")
    values = ids.flatten().to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    flags = sup.flatten().to_numpy(zero_copy_only=False).astype(bool, copy=False)
    return values, flags, offsets - offsets[0]


def _docs(values: np.ndarray, flags: np.ndarray, offsets: np.ndarray, k: int) -> Doc:
    return values[offsets[k]:offsets[k + 1]], flags[offsets[k]:offsets[k + 1]]


def docs_in_bins(docs, bins: Sequence[Sequence[int]]) -> Iterator[list[Doc]]:
    """Per bin (document indices of one window), its documents in the bin's order."""
    arrow = docs.with_format("arrow")
    for at in range(0, len(bins), BINS_AT_ONCE):
        group = bins[at:at + BINS_AT_ONCE]
        wanted = sorted({int(i) for b in group for i in b})
        row = {index: k for k, index in enumerate(wanted)}
        values, flags, offsets = _flat(arrow[wanted]) if wanted else (None, None, None)
        for b in group:
            yield [_docs(values, flags, offsets, row[int(i)]) for i in b]


def iter_docs(docs, batch: int = 1000) -> Iterator[Doc]:
    """Every document in order."""
    for table in docs.with_format("arrow").iter(batch_size=batch):
        values, flags, offsets = _flat(table)
        for k in range(len(offsets) - 1):
            yield _docs(values, flags, offsets, k)
