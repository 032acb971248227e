"""What running `datasets`' map in several processes leaves behind, put back.

`Dataset.map(num_proc > 1)` sets TOKENIZERS_PARALLELISM=false so that its forked workers run
the fast tokenizer in one thread each, then "restores" the environment by assigning a copy of
the old `os.environ`: the copy does not have the variable, but the process's own environment
(what the tokenizer's Rust code reads on every call) keeps `false`. Every later batch call of a
fast tokenizer in this process then ran in one thread instead of on every core: the validation
split's tokenizing after the training split's, a user's own calls after the preparation, and
each `num_proc` 1 run a benchmark made after a `num_proc` 2 one (datasets 5.2.0, tokenizers
0.23.3). `tokenizer_threads_kept` puts the variable back as it was.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

PARALLELISM = "TOKENIZERS_PARALLELISM"


@contextlib.contextmanager
def tokenizer_threads_kept() -> Iterator[None]:
    """TOKENIZERS_PARALLELISM after the block as it was before, in `os.environ` and in the
    process's environment alike."""
    was = os.environ.get(PARALLELISM)
    try:
        yield
    finally:
        if was is None:
            os.environ.pop(PARALLELISM, None)
            os.unsetenv(PARALLELISM)  # os.environ may be a copy that never had it
        else:
            os.environ[PARALLELISM] = was
