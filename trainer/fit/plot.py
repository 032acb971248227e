"""memory_plan.png: what each block keeps under the plan, and how activations pile up.

Bars: saved bytes per block (MiB, left axis), coloured by recompute option. Right axis, GiB per
rank: the memory that is there whatever the plan (parameters, gradients, optimizer state, FSDP's
unsharded copies, shaded) and on top of it the activations held after each block's forward (a
line); the activation budget when the policy has one, the predicted peak, and the device's memory
when known (red): the picture shows what makes a run fit or not. The title carries the totals.
"""

from __future__ import annotations

from typing import Optional

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from trainer.task import task_for  # noqa: E402

GIB, MIB = 2 ** 30, 2 ** 20
COLOURS = {"none": "#d62728", "selective": "#ff7f0e", "full": "#1f77b4"}


def plot_plan(outcome, path: str, capacity: Optional[int] = None) -> list[str]:
    """Draws memory_plan.png; returns the legend's labels (what the picture shows)."""
    est, plan = outcome.estimate, outcome.plan
    saved = [b / MIB for b in est.block_saved]
    # Memory that is there whatever the plan (at the predicted peak's moment): parameters,
    # gradients, optimizer state, FSDP's unsharded copies and temporaries. The activations
    # pile up on top of it, counted as the budget counts them: everything saved outside the
    # blocks, plus the blocks so far.
    peak = est.peak
    static = (peak.params + peak.grads + peak.optimizer + peak.unsharded) / GIB
    held, pile = outcome.profile.rest_bytes, []
    for b in est.block_saved:
        held += b
        pile.append(static + held / GIB)
    fig, bars = plt.subplots(figsize=(12, 6), dpi=110)
    positions = list(range(len(plan)))
    bars.bar(positions, saved, color=[COLOURS[p.recompute] for p in plan], width=0.85)
    bars.set_xlabel("block")
    bars.set_ylabel("saved activations per block (MiB)")
    step = max(1, len(plan) // 20)
    bars.set_xticks(positions[::step], [plan[i].name for i in positions[::step]], rotation=45,
                    ha="right", fontsize=8)
    bars.grid(axis="y", alpha=0.3)
    bars.set_ylim(0, 1.4 * max(saved + [1.0]))  # room for the legend above the bars
    pile_axis = bars.twinx()
    pile_axis.axhspan(0, static, color="grey", alpha=0.25,
                      label=f"parameters, gradients, optimizer, unsharded: {static:.2f} GiB")
    pile_axis.plot(positions, pile, color="black", linewidth=1.5,
                   label="+ activations held after the block's forward")
    handles = [Patch(color=c, label=f"recompute {o}") for o, c in COLOURS.items()]
    if outcome.budget is not None:
        pile_axis.axhline(static + outcome.budget.bytes / GIB, color="black", linestyle="--",
                          label=f"activation budget {outcome.budget.bytes / GIB:.2f} GiB")
    lines_at = [peak.total / GIB]
    if capacity is not None:
        pile_axis.axhline(capacity / GIB, color="red", linestyle="--",
                          label=f"device memory {capacity / GIB:.2f} GiB")
        lines_at.append(capacity / GIB)
    pile_axis.axhline(peak.total / GIB, color="purple", linestyle=":",
                      label=f"predicted peak {peak.total / GIB:.2f} GiB ({peak.name})")
    pile_axis.set_ylabel("memory per rank (GiB)")
    top = max(pile + lines_at + [static + (outcome.budget.bytes / GIB if outcome.budget
                                           else 0.0), 1e-3])
    pile_axis.set_ylim(0, 1.4 * top)
    lines, labels = pile_axis.get_legend_handles_labels()
    labels = [h.get_label() for h in handles] + labels
    bars.legend(handles + lines, labels, loc="upper left", fontsize=8)
    sc = outcome.scenario
    tokens = task_for(sc.cfg.model, sc.cfg.data).tokens_per_sample
    fig.suptitle(
        f"{sc.cfg.model.name}: world {sc.layout.world_size} ({sc.cfg.sharding.mode}), micro-batch "
        f"{sc.cfg.train.micro_batch_size} x {tokens}, checkpointing="
        f"{sc.cfg.checkpointing.policy}\npredicted peak {peak.total / GIB:.2f} GiB per rank, "
        f"during {peak.name}\n= params {peak.params / GIB:.2f} + grads {peak.grads / GIB:.2f} "
        f"+ optimizer {peak.optimizer / GIB:.2f} + unsharded {peak.unsharded / GIB:.2f} "
        f"+ activations {peak.activations / GIB:.2f} GiB", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return labels
