"""`python -m trainer.report --longest`: the longest data.seq_len whose step fits.

The config's own settings (plan, offload, head, tiles, sequence degree, each fixed or `auto`)
are kept; only data.seq_len (and model.max_seq_len with it) changes. Doubling from one step
finds a length that does not fit, then bisection narrows the gap to one step; given how much
of its limit each prediction uses, the search is guided by the line through the lengths tried
instead (the report's: a few predictions, from the config's own length). A length fits
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
# (outcome) -> the fraction of its binding limit it uses (device or host; <= 1: fits).
Use = Callable[[Outcome], float]


# (outcome) -> the fraction of its binding limit it uses (device or host; <= 1: fits).
Use = Callable[[Outcome], float]


def longest(scenario: Scenario, predict: Predict, step_tokens: int = STEP_TOKENS,
            use: Optional[Use] = None) -> Longest:
    """The longest multiple of step_of(scenario, step_tokens) that fits; ConfigError when none
    does.

    Without `use`: doubling from one step, then bisection (about 2 log2(n) predictions). With
    it, guided: memory grows almost linearly with the length, so the line through two lengths
    tried says where the limit is crossed. Starting from the config's own length, a handful of
    predictions find the last fitting length: every guess stays strictly inside the bracket of
    a fitting and a failing length, and after two guesses in a row on one side of the limit
    the rest is bisection, so it ends as bisection would, a few predictions later at worst. A
    70B prediction takes minutes: 4-6 of them instead of ~25."""
    step = step_of(scenario, step_tokens)
    cap = 2 ** MAX_DOUBLINGS
    tried: list[tuple[int, bool]] = []
    used: dict[int, Optional[float]] = {}
    best: list = []  # [(n, outcome, decision)] of the longest that fits

    def attempt(n: int) -> bool:
        fits, outcome, decision = predict(at_length(scenario, n * step))
        tried.append((n * step, fits))
        used[n] = None if (use is None or outcome is None) else use(outcome)
        if fits and (not best or n > best[0][0]):
            best[:] = [(n, outcome, decision)]
        return fits

    if use is None:
        low, high = _doubling(attempt, cap)
    else:
        low, high = _guided(attempt, used, cap, max(1, scenario.cfg.data.seq_len // step))
    sides: list[bool] = []  # which side each line's guess fell on
    while high is not None and high - low > 1:
        # Two guesses in a row on one side: the line misleads here (a curve, a plateau), so
        # bisection from now on.
        guided = use is not None and sides[-2:] not in ([True, True], [False, False])
        guess = _root(used, low, high) if guided else None
        n = (low + high) // 2 if guess is None else min(high - 1, max(low + 1, guess))
        fits = attempt(n)
        low, high = (n, high) if fits else (low, n)
        if guess is not None:
            sides.append(fits)
    if not best:
        raise ConfigError("data.seq_len", f"not even {step} tokens fit (the shortest length "
                          "--longest tries); see the report without --longest")
    n, outcome, decision = best[0]
    return Longest(n * step, outcome, decision, tuple(tried))


def _doubling(attempt: Callable[[int], bool], cap: int) -> tuple[int, Optional[int]]:
    """(low, high): low fits (0: none), high does not (None: even `cap` steps fit)."""
    low, n = 0, 1
    while attempt(n):
        low = n
        if n >= cap:
            return low, None
        n = min(cap, 2 * n)
    return low, n


def _guided(attempt: Callable[[int], bool], used: dict, cap: int, start: int
            ) -> tuple[int, Optional[int]]:
    """_doubling's bracket, from `start` steps: halving while nothing fits; growing past the
    line's crossing (at most x8) while everything fits."""
    n, high = min(start, cap), None
    while not attempt(n):
        high = n
        if n == 1:
            return 0, 1
        n //= 2
    if high is not None:
        return n, high
    low, previous = n, None
    while low < cap:
        # One length: as if use grew in proportion to it (the fixed part, parameters and
        # state, puts the crossing before that: a failing length just past it, likely).
        ahead = _root(used, previous, low) if previous else _proportional(used[low], low)
        n = min(cap, 2 * low if ahead is None else min(8 * low, max(low + 1, ahead + 1)))
        if not attempt(n):
            return low, n
        previous, low = low, n
    return low, None


def _proportional(use: Optional[float], n: int) -> Optional[int]:
    return None if not use else math.floor(n / use + 1e-6)


def _root(used: dict, a: int, b: int) -> Optional[int]:
    """The last whole step at or before where the line through (a, use a) and (b, use b)
    reaches 1 (the limit); None when a use is unknown or the line does not rise."""
    ua, ub = used.get(a), used.get(b)
    if ua is None or ub is None or ub <= ua:
        return None
    # A hair over: a crossing that is a whole step in exact arithmetic stays that step.
    return math.floor(a + (1.0 - ua) * (b - a) / (ub - ua) + 1e-6)
