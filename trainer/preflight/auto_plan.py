"""Fitting a run to its memory: `checkpointing=auto` and `train.micro_batch_size=auto`.

For every candidate micro-batch (one, or with `auto` every divisor of this rank's share of
`train.global_batch_size`, largest first), the memory model (checkpointing/planner/memory.py, the
report's) is measured on meta at that shape. A candidate no plan can fit is dropped without
timing; the others get their step time: the trainer times each distinct block on the device
(checkpointing/planner/profile.py), the report uses FLOPs at a nominal rate. Then
`checkpointing=auto` takes the fastest plan that fits (checkpointing/planner/whole_step.py), a
fixed policy its own plan, and the candidate with the least predicted step time wins, except that the largest micro-batch within
MICRO_BATCH_MARGIN of it is taken instead (costs per micro-batch are not all timed). Every
candidate considered, with the uniform policies beside auto's plan, is kept as a table.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from checkpointing.planner.whole_step import Choice, NoFit, Timing, evaluate_plan, fastest_plan
from checkpointing.plan import (BlockPlan, describe, make_plan, recompute_pattern, with_offload,
                                with_tiles)
from checkpointing.planner.profile import BlockProfile
from trainer.config import Config, ConfigError, tile_count
from sharding.layout import Layout, auto_degrees
from trainer.preflight.scenario import (NOMINAL_ALL_TO_ALL_BYTES_PER_S, NOMINAL_SECONDS_PER_BYTE,
                                       Evaluator, Scenario, with_changes)

GIB = 2 ** 30
UNIFORM = ("none", "selective", "full")
# A larger micro-batch wins over a smaller one predicted faster by less than this: every
# micro-batch also pays what the block timings cannot see (FSDP's hooks, all-gathers and
# reduce-scatters per micro-batch, the loss, the data threads' share of the cores); on this
# project's CPU machine the smallest micro-batches ran 10-30% slower than predicted.
MICRO_BATCH_MARGIN = 0.10


@dataclass(frozen=True)
class Candidate:
    micro_batch: int
    grad_accum: int
    policy: str  # auto (the planner's plan at this micro-batch) or the uniform policy shown
    plan: str  # describe() of the plan, or why there is none
    peak_bytes: int  # predicted; for a candidate nothing fits: the least any plan needs
    step_s: Optional[float]  # predicted seconds per optimizer step; None when not timed
    fits: bool
    chosen: bool = False
    sequence: int = 1  # sharding.sequence of this candidate
    tiles: int = 1  # checkpointing.tiles of this candidate
    context: int = 1  # sharding.context of this candidate
    why: str = ""  # why it was refused or chosen


@dataclass(frozen=True)
class Decision:
    micro_batch: int
    grad_accum: int
    plan: list[BlockPlan]
    capacity: int
    peak_bytes: int
    step_s: float
    candidates: list[Candidate]
    profiles: Optional[list[BlockProfile]] = None  # device profiles at the chosen micro-batch
    reused: bool = False  # read back from an earlier start of the run (preflight/auto_run.py)
    sequence: int = 1  # the sharding.sequence chosen
    tiles: int = 1  # the checkpointing.tiles chosen
    context: int = 1  # the sharding.context chosen


# (cfg at one micro-batch, its scenario, the meta profile's evaluator) -> (timing, profiles)
Timer = Callable[[Config, Scenario, Evaluator], tuple[Timing, Optional[list[BlockProfile]]]]


def gib(nbytes: int) -> str:
    """Bytes as GiB with three significant digits (0.0372 GiB, 1.25 GiB, 164 GiB)."""
    return f"{nbytes / GIB:.3g} GiB"


def auto_decides(cfg: Config, layout: Layout) -> bool:
    """Whether `auto` decides something: the plan, the tiles, or what the layout leaves to it
    (the micro-batch, the sequence degree)."""
    return (cfg.checkpointing.policy == "auto" or cfg.checkpointing.tiles == "auto"
            or bool(layout.pending))


def micro_batches(layout: Layout) -> list[int]:
    """The candidates, largest first. A sequence group of N ranks shares each sample, so the
    global batch is split over the layout's world / N groups."""
    if layout.micro_batch != "auto":
        return [layout.micro_batch_size]
    per_rank = layout.per_rank_samples()
    return [m for m in range(per_rank, 0, -1) if per_rank % m == 0]


def at_micro_batch(scenario: Scenario, micro_batch: int) -> Scenario:
    return with_changes(scenario, train={"micro_batch_size": micro_batch})


def at_decision(scenario: Scenario, decision: Decision) -> Scenario:
    """The scenario with what `auto` chose: micro-batch, sequence degree, tiles."""
    return with_changes(at_sequence(scenario, decision.sequence, decision.context,
                                    decision.tiles),
                        train={"micro_batch_size": decision.micro_batch})


def fixed_plan(cfg: Config, names: Sequence[str], policy: Optional[str] = None) -> list[BlockPlan]:
    """The plan of a profile-free policy, with offload as the trainer applies it."""
    c, shard = cfg.checkpointing, cfg.sharding.mode != "none"
    if (policy or c.policy) == "file":
        from trainer.state.planfile import read_plan

        return read_plan(c.plan_file, names, shard, cfg.train.compile)
    plan = make_plan(names, recompute_pattern(policy or c.policy, len(names), c.every), shard)
    return with_offload(plan, cfg.offload.target, cfg.offload.keep_last)


def flop_timing(evaluator: Evaluator) -> Timer:
    """Step times from FLOPs at the evaluator's nominal rate (the report: nothing is timed)."""
    def timer(cfg: Config, scenario: Scenario, ev: Evaluator):
        degree = scenario.layout.degree
        profile = ev.profile(cfg, degree)[0]
        spf = evaluator.seconds_per_flop
        rest = rest_flops(cfg, profile, degree) * spf
        timing = Timing(tuple({o: f * spf for o, f in m.recompute_flops.items()}
                              for m in profile.blocks),
                        tuple(m.step_flops() * spf for m in profile.blocks), rest,
                        NOMINAL_SECONDS_PER_BYTE.get(cfg.offload.target))
        return with_sequence_costs(timing, profile, scenario, spf), None
    return timer


def with_sequence_costs(timing: Timing, profile, scenario: Scenario,
                        seconds_per_flop: float) -> Timing:
    """Add what tiles and sequence parallelism cost to a block timing that has neither.

    Tiles: the tiled MLP's forward once more in backward (its FLOPs at `seconds_per_flop`).
    Ulysses: the bytes a rank sends per block forward (measured on meta) over a nominal
    all-to-all bandwidth (NOMINAL_ALL_TO_ALL_BYTES_PER_S, nothing measured or overlapped): twice
    per block (forward, backward), and once more for a block that recomputes. The ring
    (sharding.context): its forward and backward sends (measured on meta) over the same
    nominal rates, not overlapped with attention (an upper bound; `ring_seconds`)."""
    degree = scenario.layout.degree
    inside = "node" if degree <= scenario.gpus_per_node else "network"
    exchange = profile.sent_bytes_per_block / NOMINAL_ALL_TO_ALL_BYTES_PER_S[inside]
    from trainer.preflight.exchange import ring_seconds

    ring_forward, ring_backward, _ = ring_seconds(profile, scenario)
    compute = tuple(c + m.tile_flops * seconds_per_flop + 2 * exchange + ring_forward
                    + ring_backward
                    for c, m in zip(timing.block_compute, profile.blocks, strict=True))
    cost = tuple({o: s + (exchange + ring_forward if o != "none" else 0.0)
                  for o, s in c.items()} for c in timing.block_cost)
    return dataclasses.replace(timing, block_cost=cost, block_compute=compute)


def rest_flops(cfg: Config, profile, degree: int = 1) -> float:
    """Training FLOPs of one micro-batch outside the blocks (embedding, head, loss), on one
    rank of a sequence group of `degree`: the output layer's matmuls, 6 FLOPs per weight and
    token it sees (forward and backward; a language model's tokens, on the supervised rows only
    where it gathers them; a classifier's one pooled token per sample). The embedding is a
    lookup; norms and the loss are elementwise. (Not the model's conventional count less the
    blocks': that counts attention without its causal mask, and the blocks' count has it.)"""
    from torch import nn

    from trainer.build import build_on_meta
    from trainer.task import task_for

    task = task_for(cfg.model, cfg.data, cfg.checkpointing)
    model = build_on_meta(cfg.model)
    head = set(profile.head.grad_param_names)
    matmul = sum(p.numel() for n, p in model.named_parameters() if n in head and p.dim() == 2)
    # A frozen output layer (LoRA's base) has no weight gradient: 4 FLOPs per weight and token.
    frozen = sum(m.weight.numel() for n, m in model.named_modules()
                 if isinstance(m, nn.Linear) and not m.weight.requires_grad
                 and not n.startswith(tuple(f"{b}." for b in profile.block_names)))
    tokens = task.head_rows_per_sample
    # A rank of a sequence group computes 1/N of each sample (its tokens), and 1/M more of it
    # in a ring of M (sharding.context).
    return ((6.0 * matmul + 4.0 * frozen) * tokens / (degree * cfg.sharding.context)
            * cfg.train.micro_batch_size)


# checkpointing.tiles=auto tries 1, 2, 4, ... up to this many tiles (or one token per tile).
MAX_AUTO_TILES = 256


def sequence_shapes(cfg: Config, layout: Layout,
                    gpus_per_node: Optional[int] = None) -> list[tuple[int, int, int]]:
    """(sequence degree, context, tiles) `auto` tries, in its order of preference: the fewest
    ranks per sample first (fewest exchanges; Ulysses inside a node, the ring beyond it or
    past the heads: trainer/preflight/splits.py), then the fewest tiles (least recompute).
    gpus_per_node None: one node holds the world."""
    from trainer.preflight.splits import sample_splits

    seq_len = cfg.data.seq_len
    shapes = []
    for degree, context in sample_splits(cfg, layout, gpus_per_node or layout.world_size):
        if cfg.checkpointing.tiles == "auto":
            most = min(MAX_AUTO_TILES, seq_len // (degree * context))
            tiles = [1 << i for i in range(most.bit_length()) if 1 << i <= most]
        else:
            tiles = [tile_count(cfg.checkpointing)]
        shapes += [(degree, context, t) for t in tiles]
    return shapes


def at_sequence(scenario: Scenario, degree: int, context: int, tiles: int) -> Scenario:
    return with_changes(scenario, sharding={"sequence": degree, "context": context},
                        checkpointing={"tiles": tiles})


def decide(cfg: Config, scenario: Scenario, evaluator: Evaluator, capacity: int,
           timer: Timer) -> Decision:
    """The smallest sequence degree and tile count (when `auto`) at which something fits, then
    the micro-batch and plan with the least predicted step time that fit `capacity`."""
    shapes = sequence_shapes(cfg, scenario.layout, scenario.gpus_per_node)
    if len(shapes) == 1:
        return _decide_at(at_sequence(scenario, *shapes[0]), evaluator, capacity, timer)
    refused: list[Candidate] = []
    last: Optional[ConfigError] = None
    for degree, context, tiles in shapes:
        try:
            at = at_sequence(scenario, degree, context, tiles)
            decision = _decide_at(at, evaluator, capacity, timer)
        except (ConfigError, ValueError) as exc:  # nothing fits, or the degree is refused
            last = exc if isinstance(exc, ConfigError) else ConfigError("sharding.sequence",
                                                                        str(exc))
            refused.append(Candidate(0, 0, cfg.checkpointing.policy, "refused", 0, None, False,
                                     sequence=degree, tiles=tiles, context=context,
                                     why=str(exc).split(": ", 1)[-1]))
            continue
        chosen_why = (f"the smallest sequence degree and tile count that fit "
                      f"({len(refused)} smaller refused)")
        rows = [dataclasses.replace(r, why=r.why or (chosen_why if r.chosen else ""))
                for r in decision.candidates]
        return dataclasses.replace(decision, candidates=refused + rows)
    assert last is not None
    raise ConfigError(last.key, f"no sequence degree or tile count tried fits "
                      f"({', '.join(_shape(*shape) for shape in shapes)}); the "
                      f"largest tried: {str(last).split(': ', 1)[-1]}")


def _shape(degree: int, context: int, tiles: int) -> str:
    return f"sequence {degree}" + (f" context {context}" if context > 1 else "") + \
        f" tiles {tiles}"


def _decide_at(scenario: Scenario, evaluator: Evaluator, capacity: int,
               timer: Timer) -> Decision:
    """At the scenario's sequence degree and tiles: the micro-batch and plan with the least
    predicted step time that fit `capacity`."""
    cfg = scenario.cfg
    degree, tiles = scenario.layout.degree, tile_count(cfg.checkpointing)
    context = scenario.layout.context
    policy = cfg.checkpointing.policy
    rows: list[Candidate] = []
    timed: list[tuple[Choice, int, int, Optional[list[BlockProfile]]]] = []
    least: Optional[tuple[int, int]] = None  # (bytes, micro-batch) when none fits
    for micro_batch in micro_batches(scenario.layout):
        at = at_micro_batch(scenario, micro_batch)
        profile, groups, _ = evaluator.profile(at.cfg, degree)
        setup = evaluator.setup(at)
        names = list(profile.block_names)
        accum = at.layout.grad_accum
        untimed = Timing(tuple({o: 0.0 for o in UNIFORM} for _ in names),
                         tuple(0.0 for _ in names), 0.0)
        try:  # memory first: a candidate nothing fits is not worth timing on the device
            choice = _choose(at.cfg, policy, groups, profile, setup, untimed, capacity)
        except NoFit as exc:
            rows.append(Candidate(micro_batch, accum, policy, "no plan fits", exc.least, None,
                                  False, sequence=degree, tiles=tiles, context=context,
                                  why=f"no plan fits: the least is {gib(exc.least)}"))
            if least is None or exc.least < least[0]:
                least = (exc.least, micro_batch)
            continue
        timing, profiles = timer(at.cfg, at, evaluator)
        choice = _choose(at.cfg, policy, groups, profile, setup, timing, capacity)
        rows.append(Candidate(micro_batch, accum, policy, describe(choice.plan), choice.peak,
                              choice.step_s, True, sequence=degree, tiles=tiles,
                              context=context))
        if policy == "auto":  # the uniform policies beside it, for the record
            for uniform in UNIFORM:
                other = evaluate_plan(groups, profile, setup, timing,
                                      fixed_plan(at.cfg, names, uniform))
                rows.append(Candidate(micro_batch, accum, uniform, describe(other.plan),
                                      other.peak, other.step_s, other.peak <= capacity,
                                      sequence=degree, tiles=tiles, context=context))
        timed.append((choice, micro_batch, accum, profiles))
    if not timed:
        raise ConfigError("train.memory_gib", no_fit_message(cfg, scenario, evaluator, capacity,
                                                             least, rows))
    fastest = min(c[0].step_s for c in timed)
    # Candidates come largest micro-batch first: the first within the margin of the fastest.
    choice, micro_batch, accum, profiles = next(
        c for c in timed if c[0].step_s <= fastest * (1 + MICRO_BATCH_MARGIN))
    rows = [dataclasses.replace(r, chosen=True) if (r.micro_batch, r.policy) ==
            (micro_batch, policy) else r for r in rows]
    return Decision(micro_batch, accum, with_tiles(choice.plan, tiles), capacity, choice.peak,
                    choice.step_s, rows, profiles, sequence=degree, tiles=tiles,
                    context=context)


def _choose(cfg: Config, policy: str, groups, profile, setup, timing: Timing,
            capacity: int) -> Choice:
    if policy == "auto":
        return fastest_plan(groups, profile, setup, timing, capacity,
                            cfg.sharding.mode != "none", cfg.offload.keep_last,
                            cfg.offload.target)
    choice = evaluate_plan(groups, profile, setup, timing,
                           fixed_plan(cfg, list(profile.block_names)))
    if choice.peak > capacity:
        raise NoFit(capacity, choice.peak)
    return choice


def no_fit_message(cfg: Config, scenario: Scenario, evaluator: Evaluator, capacity: int,
                   least: Optional[tuple[int, int]], rows: Sequence[Candidate]) -> str:
    """One line: the capacity, the least that works, and what else would make it fit."""
    what = f"checkpointing={cfg.checkpointing.policy}"
    assert least is not None
    smallest = min(r.micro_batch for r in rows)
    text = (f"{gib(capacity)} per rank is too small for {what}: the least that fits is "
            f"{gib(least[0])} (micro-batch {least[1]})")
    others = alternatives(cfg, at_micro_batch(scenario, smallest), evaluator, capacity)
    if not others:  # "change one of these" would point at nothing
        return text + "; raise train.memory_gib (no other setting tried makes it fit)"
    return (text + "; it would fit with " + " or ".join(others)
            + "; raise train.memory_gib or change one of these")


def alternatives(cfg: Config, scenario: Scenario, evaluator: Evaluator,
                 capacity: int) -> list[str]:
    """Changes that make the least-memory plan of this micro-batch fit, each predicted."""
    s, found = cfg.sharding, []
    untimed = flop_timing(evaluator)

    def least(changed: Scenario) -> Optional[int]:
        profile, groups, _ = evaluator.profile(changed.cfg, changed.layout.degree)
        timing = untimed(changed.cfg, changed, evaluator)[0]
        try:
            return fastest_plan(groups, profile, evaluator.setup(changed), timing, capacity,
                                s.mode != "none", changed.cfg.offload.keep_last,
                                changed.cfg.offload.target).peak
        except NoFit:
            return None

    tries = []
    if s.mode != "none" and evaluator.device_type == "cuda" and not s.cpu_offload:
        tries.append(("sharding.cpu_offload=true", lambda: with_changes(
            scenario, sharding={"cpu_offload": True})))
    if s.mode != "none" and s.param_dtype != "bfloat16":
        tries.append(("sharding.param_dtype=bfloat16 sharding.reduce_dtype=float32",
                      lambda: with_changes(scenario, sharding={"param_dtype": "bfloat16",
                                                               "reduce_dtype": "float32"})))
    if s.mode == "fsdp":
        for factor in (2, 4, 8, 16, 32, 64):
            world = scenario.layout.world_size * factor
            tries.append((f"{world} ranks", lambda w=world: with_changes(
                scenario, world_size=w, nodes=max(1, w // scenario.gpus_per_node),
                train={"global_batch_size": None, "grad_accum": scenario.layout.grad_accum})))
    ranks_found = False
    for text, make in tries:
        if text.endswith("ranks") and ranks_found:
            continue
        try:
            peak = least(make())
        except ConfigError:  # the trainer would refuse this change
            peak = None
        if peak is not None:
            found.append(f"{text} ({gib(peak)})")
            ranks_found = ranks_found or text.endswith("ranks")
    return found


def auto_table(decision: Decision) -> str:
    """The candidates as a terminal table, the chosen one marked."""
    lines = [f"{'':1} {'seq':>3} {'ctx':>3} {'tiles':>5} {'micro':>5} {'accum':>5} {'policy':<9} "
             f"{'predicted peak GiB':>18} {'step s':>9} {'fits':<4} plan"]
    for r in decision.candidates:
        lead = f"{'*' if r.chosen else ' ':1} {r.sequence:>3} {r.context:>3} {r.tiles:>5}"
        if r.plan == "refused":  # a degree or tile count at which nothing was fitted
            lines.append(f"{lead} {'-':>5} {'-':>5} {r.policy:<9} {'-':>18} {'-':>9} no   "
                         f"{r.why}")
            continue
        step = f"{r.step_s:9.4f}" if r.step_s is not None else f"{'-':>9}"
        least = "" if r.fits or r.step_s is not None else " (least)"
        lines.append(f"{lead} {r.micro_batch:>5} {r.grad_accum:>5} "
                     f"{r.policy:<9} {r.peak_bytes / GIB:>18.4f} {step} "
                     f"{'yes' if r.fits else 'no':<4} {r.plan}{least}")
    return "\n".join(lines)


def auto_rows(decision: Decision) -> list[dict]:
    return [dataclasses.asdict(r) for r in decision.candidates]
