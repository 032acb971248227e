"""memory_plan.png: what each block keeps under the plan, and how activations pile up.

Bars: saved bytes per block (MiB, left axis), coloured by recompute option. Line: activations
held after each block's forward (all outside-block saved bytes plus the blocks so far, as the
budget counts them; GiB, right axis); the activation budget, when the policy has one, is a dashed
line on the same axis, since it bounds that pile. The title carries the per-rank totals.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from trainer.task import task_for  # noqa: E402

GIB, MIB = 2 ** 30, 2 ** 20
COLOURS = {"none": "#d62728", "selective": "#ff7f0e", "full": "#1f77b4"}


def plot_plan(outcome, path: str) -> None:
    est, plan = outcome.estimate, outcome.plan
    saved = [b / MIB for b in est.block_saved]
    # Counted as the budget counts them: everything saved outside the blocks, plus blocks so far.
    held, pile = outcome.profile.rest_bytes, []
    for b in est.block_saved:
        held += b
        pile.append(held / GIB)
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
    pile_axis.plot(positions, pile, color="black", linewidth=1.5,
                   label="held after the block's forward (outside blocks included)")
    handles = [Patch(color=c, label=f"recompute {o}") for o, c in COLOURS.items()]
    if outcome.budget is not None:
        pile_axis.axhline(outcome.budget.bytes / GIB, color="black", linestyle="--",
                          label=f"budget {outcome.budget.bytes / GIB:.2f} GiB")
    pile_axis.set_ylabel("activations held (GiB)")
    top = max(pile + [outcome.budget.bytes / GIB if outcome.budget else 0.0, 1e-3])
    pile_axis.set_ylim(0, 1.4 * top)
    lines, labels = pile_axis.get_legend_handles_labels()
    bars.legend(handles + lines, [h.get_label() for h in handles] + labels, loc="upper left",
                fontsize=8)
    sc, peak = outcome.scenario, est.peak
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
