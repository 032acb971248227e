"""memory_plan.png: memory per rank over one step, and what each block keeps under the plan.

Top: one GiB axis, the step in time order (trainer/preflight/timeline.py): the floor (parameters and
optimizer state, gradients, unsharded copies and temporaries) stacked under the activations as
they pile up block by block through the forward, the head's spike (output layer and loss), their
release through the backward, and the optimizer step; the predicted peak with its phase, the
device's memory when known and the activation budget when the policy has one. Bottom: each
block's saved bytes under the plan, coloured by recompute option, on its own axis (MiB or GiB by
size: a block's bytes would vanish on the step's scale). Legends sit beside the panels, never on
the data. `draw_plan` returns the figure for tests; `plot_plan` writes it.
"""

from __future__ import annotations

from typing import Optional

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from trainer.preflight.timeline import GIB, Timeline, gib, timeline  # noqa: E402
from trainer.preflight.tables import sequence_text  # noqa: E402
from trainer.task import task_for  # noqa: E402

MIB = 2 ** 20
COLOURS = {"none": "#d62728", "selective": "#ff7f0e", "full": "#1f77b4", "compiler": "#8c564b"}
# Bottom to top of the stack: (Segment field, legend label, colour).
BANDS = (("persistent", "parameters + optimizer state", "#9e9e9e"),
         ("grads", "gradients", "#c5b0d5"),
         ("unsharded", "unsharded copies, temporaries", "#f7c98b"),
         ("activations", "activations (saved; in backward + working set)", "#74c476"))
HEAD_COLOUR, PEAK_COLOUR, DEVICE_COLOUR = "#e7298a", "black", "#d62728"
# The device's line is drawn to scale only when it is within this factor of the step's top:
# 141 GiB over a 20 GiB step would flatten the step into the bottom of the panel.
DEVICE_SCALE = 2.0


def _stack(ax, t: Timeline) -> list[float]:
    """The stacked bands and the step's outline; returns the outline's values (GiB)."""
    edges = list(range(len(t.segments) + 1))
    base = [0.0] * len(t.segments)
    for field, label, colour in BANDS:
        top = [b + getattr(s, field) / GIB for b, s in zip(base, t.segments)]
        ax.stairs(top, edges, baseline=base, fill=True, color=colour, label=label, gid=field)
        base = top
    # The head's own activations, only in its segment: the spike.
    top = [b + s.head / GIB for b, s in zip(base, t.segments)]
    ax.stairs(top, edges, baseline=base, fill=True, color=HEAD_COLOUR, gid="head",
              label=f"the head (output layer, loss): +{gib(t.head)}")
    ax.stairs(top, edges, baseline=None, color="black", linewidth=0.8, gid="total")
    return top


def _stage_ticks(ax, t: Timeline) -> None:
    """One tick per stage (forward, head, backward, optimizer step), separated by thin lines."""
    stages: dict[str, list[int]] = {}
    for i, s in enumerate(t.segments):
        stages.setdefault(s.stage, []).append(i)
    names = [s.name.removesuffix(" forward") for s in t.segments if s.stage == "forward"]
    back = [s.name.split(" ")[0] for s in t.segments if s.stage == "backward"]
    text = {"forward": f"forward\n{names[1] if len(names) > 1 else ''} → {names[-1]}",
            "head": "head", "backward": f"backward\n{back[0]} → embedding",
            "optimizer": "optimizer\nstep"}
    ticks = [(min(i) + max(i) + 1) / 2 for i in stages.values()]
    ax.set_xticks(ticks, [text[k] for k in stages], fontsize=9)
    ax.set_xticks(range(len(t.segments) + 1), minor=True)
    for i in stages.values():
        ax.axvline(max(i) + 1, color="grey", linewidth=0.6, alpha=0.6)
    ax.set_xlim(0, len(t.segments))


def _timeline_panel(ax, outcome, capacity: Optional[int]) -> list[str]:
    t = timeline(outcome)
    outline = _stack(ax, t)
    _stage_ticks(ax, t)
    top = max(outline + [1e-6])
    if outcome.budget is not None:  # activations may reach floor + budget at every moment
        limit = [s.floor / GIB + outcome.budget.bytes / GIB for s in t.segments]
        ax.stairs(limit, range(len(t.segments) + 1), baseline=None, color="#006d2c",
                  linestyle="--", linewidth=1.2, gid="budget",
                  label=f"activation budget {gib(outcome.budget.bytes)} (over the floor)")
        top = max(top, *limit)
    if capacity is not None:
        on_scale = capacity / GIB <= DEVICE_SCALE * top
        label = f"device memory {gib(capacity)}"
        if not on_scale:
            label += f" (above this scale: {gib(capacity - t.peak)} free at the peak)"
        ax.axhline(capacity / GIB, color=DEVICE_COLOUR, linestyle="--", linewidth=1.5,
                   gid="device", label=label)
        top = max(top, capacity / GIB) if on_scale else top
    peak = t.peak / GIB
    ax.axhline(peak, color=PEAK_COLOUR, linestyle=":", linewidth=1.2, gid="peak",
               label=f"predicted peak {gib(t.peak)}\nduring {t.peak_name}")
    at = next(i for i, v in enumerate(outline) if abs(v - peak) <= 1e-9 * max(peak, 1.0))
    ax.plot([at + 0.5], [peak], marker="v", color=PEAK_COLOUR, markersize=7, gid="peak-marker")
    ax.annotate(f"peak {gib(t.peak)}", (at + 0.5, peak), xytext=(0, 6),
                textcoords="offset points", ha="center", fontsize=9)
    ax.set_ylim(0, 1.15 * top)
    ax.set_ylabel("memory per rank (GiB)")
    ax.set_title("memory per rank over one step", fontsize=10, loc="left")
    ax.grid(axis="y", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0),
              borderaxespad=0.0, fontsize=8)
    return labels[::-1]


def _blocks_panel(ax, outcome) -> list[str]:
    plan, saved = outcome.plan, outcome.estimate.block_saved
    unit, size = ("GiB", GIB) if max(saved, default=0) >= GIB else ("MiB", MIB)
    # evaluate() counts a compiler-placed block as keeping everything (as_modelled): its bars
    # are the compiler's, at that bound.
    compiled = outcome.scenario.cfg.checkpointing.policy == "compiler"
    options = ["compiler" if compiled else p.recompute for p in plan]
    positions = range(len(plan))
    ax.bar(positions, [b / size for b in saved], color=[COLOURS[o] for o in options],
           width=0.85)
    step = max(1, len(plan) // 24)
    ax.set_xticks(positions[::step], [plan[i].name for i in positions[::step]], rotation=45,
                  ha="right", fontsize=8)
    ax.set_xlim(-0.6, len(plan) - 0.4)
    ax.set_ylabel(f"saved per block ({unit})")
    ax.grid(axis="y", alpha=0.3)
    profile = outcome.profile
    ax.set_title(f"activations each block keeps for its backward: {gib(sum(saved))} in all "
                 f"(outside the blocks: {gib(profile.before_blocks_bytes)} before them, "
                 f"{gib(profile.head.saved_bytes)} in the head)", fontsize=10, loc="left")
    present = [o for o in COLOURS if o in options]
    labels = [f"recompute {o}" + (" (bounded as none)" if o == "compiler" else "")
              for o in present]
    ax.legend([Patch(color=COLOURS[o]) for o in present], labels, loc="upper left",
              bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=8)
    return labels


def draw_plan(outcome, capacity: Optional[int] = None) -> tuple[Figure, list[str]]:
    """The figure (the caller closes it) and the legends' labels, top panel first."""
    fig, (steps, blocks) = plt.subplots(2, 1, figsize=(14, 9), dpi=110, layout="constrained",
                                        height_ratios=(3, 1.4))
    labels = _timeline_panel(steps, outcome, capacity) + _blocks_panel(blocks, outcome)
    est, sc = outcome.estimate, outcome.scenario
    tokens = task_for(sc.cfg.model, sc.cfg.data, sc.cfg.checkpointing).tokens_per_sample
    host = (f"; parameters, gradients and optimizer state in host memory: {gib(est.host)}"
            if est.host else "")
    if est.host_activations:
        host += (f"; offloaded activations in pinned host memory: {gib(est.host_activations)} "
                 f"per rank, {gib(est.host_activations * sc.gpus_per_node)} per node")
    fig.suptitle(
        f"{sc.cfg.model.name}: world {sc.layout.world_size} ({sc.cfg.sharding.mode}), "
        f"micro-batch {sc.cfg.train.micro_batch_size} x {tokens} tokens"
        f"{sequence_text(sc, tokens)}, grad_accum "
        f"{sc.layout.grad_accum}, checkpointing={sc.cfg.checkpointing.policy}\npredicted peak "
        f"{gib(est.peak.total)} per rank, during {est.peak.name}{host}", fontsize=11)
    return fig, labels


def plot_plan(outcome, path: str, capacity: Optional[int] = None) -> list[str]:
    """Draws memory_plan.png; returns the legends' labels (what the picture shows)."""
    fig, labels = draw_plan(outcome, capacity)
    fig.savefig(path)
    plt.close(fig)
    return labels
