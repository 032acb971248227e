"""`python -m trainer.report --longest`: the longest data.seq_len whose step fits.

The config's own settings (plan, offload, head, tiles, sequence degree, each fixed or `auto`)
are kept; only data.seq_len (and model.max_seq_len with it) changes. Doubling from one step
finds a length that does not fit, then bisection narrows the gap to one step. A length fits
when its predicted peak is within the device capacity and its host memory within
--host-memory-gib. The step is 1024 tokens times whatever the sequence degree must divide
(the degree, or with `auto` the world size), so every length tried is one the trainer takes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from trainer.config import ConfigError
from trainer.preflight.scenario import Outcome, Scenario, with_changes

# Lengths are tried in multiples of this many tokens (times the sequence degree).
STEP_TOKENS = 1024
MAX_DOUBLINGS = 16  # 1024 * 2**16 = 64M tokens per sample: beyond any model here


@dataclass(frozen=True)
class Longest:
    seq_len: int
    outcome: Outcome
    decision: Optional[object]  # auto's Decision at that length, when auto decides
    tried: tuple[tuple[int, bool], ...]  # (seq_len, fits) in the order tried


def step_of(scenario: Scenario, tokens: int = STEP_TOKENS) -> int:
    layout = scenario.layout
    divides = layout.world_size if layout.sequence == "auto" else layout.degree
    if layout.context > 1:  # each ring place holds 2 of 2M equal chunks, split N ways
        divides *= 2 * layout.context
    return math.lcm(tokens, divides)


def at_length(scenario: Scenario, seq_len: int) -> Scenario:
    model = scenario.cfg.model
    return with_changes(scenario, data={"seq_len": seq_len},
                        model={"max_seq_len": max(seq_len, model.max_seq_len)})


# (scenario) -> (fits, outcome, decision); the report's own prediction of one config.
Predict = Callable[[Scenario], tuple[bool, Optional[Outcome], Optional[object]]]


def longest(scenario: Scenario, predict: Predict, step_tokens: int = STEP_TOKENS) -> Longest:
    """The longest multiple of step_of(scenario, step_tokens) that fits; ConfigError when none
    does."""
    step = step_of(scenario, step_tokens)
    tried: list[tuple[int, bool]] = []
    best: Optional[tuple[int, Outcome, Optional[object]]] = None

    def attempt(n: int) -> bool:
        nonlocal best
        fits, outcome, decision = predict(at_length(scenario, n * step))
        tried.append((n * step, fits))
        if fits and (best is None or n * step > best[0]):
            best = (n * step, outcome, decision)
        return fits

    low, high = 0, None  # low fits (0: nothing yet), high does not
    n = 1
    for _ in range(MAX_DOUBLINGS + 1):
        if not attempt(n):
            high = n
            break
        low, n = n, 2 * n
    if high is None:  # fits at the largest length tried: report that one
        assert best is not None
        return Longest(best[0], best[1], best[2], tuple(tried))
    while high - low > 1:
        middle = (low + high) // 2
        if attempt(middle):
            low = middle
        else:
            high = middle
    if best is None:
        raise ConfigError("data.seq_len", f"not even {step} tokens fit (the shortest length "
                          "--longest tries); see the report without --longest")
    return Longest(best[0], best[1], best[2], tuple(tried))
