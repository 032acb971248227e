"""A ready W&B workspace for blocktrain runs: loss, throughput, the memory story, the plan, alerts.

    python -m trainer.workspace --entity ENTITY --project blocktrain            # print it
    python -m trainer.workspace --entity ENTITY --project blocktrain --save     # create it

Built with wandb-workspaces, W&B's own library for workspaces as code (`pip install
blocktrain[wandb]`). `--save` needs a W&B login and network; it prints the workspace's URL. The
panels name only keys the trainer logs (tests/test_dashboard.py holds them to a real run).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from trainer.observe.watch import KINDS

# Section -> history keys drawn as line plots over the step.
LINES = {
    "Loss": ["loss", "val_loss", "lr", "grad_norm"],
    "Throughput": ["tokens_per_s", "mfu", "step_time_s", "data_wait_s"],
    "Memory": ["peak_mem_bytes", "peak_reserved_bytes", "act_saved_bytes", "offloaded_bytes",
               "live_peak_bytes"],
    "Alerts": [f"alert/{kind}" for kind in KINDS],
}
# Keys only some runs log: CUDA (mfu, reserved), offload, a live-bytes step, each alert.
CONDITIONAL = {"mfu", "peak_reserved_bytes", "offloaded_bytes", "live_peak_bytes",
               *LINES["Alerts"]}
SUMMARY_BARS = ["memory/predicted_peak_bytes", "memory/measured_peak_bytes"]
TABLES = ["plan_blocks", "memory_plan", "plan"]
IMAGES = ["memory_plan_png"]


def build(entity: str, project: str, name: str):
    import wandb_workspaces.reports.v2 as wr
    import wandb_workspaces.workspaces as ws

    sections = [ws.Section(name=title, is_open=True,
                           panels=[wr.LinePlot(title=key, x="Step", y=[key]) for key in keys])
                for title, keys in LINES.items() if title != "Alerts"]
    sections.append(ws.Section(name="Predicted vs measured memory", is_open=True, panels=[
        wr.BarPlot(title="peak bytes per rank: predicted vs measured",
                   metrics=[wr.SummaryMetric(key) for key in SUMMARY_BARS]),
        wr.MediaBrowser(title="memory_plan.png", media_keys=IMAGES)]))
    sections.append(ws.Section(name="Per-block plan", is_open=True, panels=[
        wr.WeavePanelSummaryTable(table_name=table) for table in TABLES]))
    sections.append(ws.Section(name="Alerts", is_open=True, panels=[
        wr.LinePlot(title="alerts (1 = fired at that step)", x="Step", y=LINES["Alerts"],
                    line_marks={key: "points" for key in LINES["Alerts"]})]))
    return ws.Workspace(entity=entity, project=project, name=name, sections=sections)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entity", required=True, help="W&B entity (user or team)")
    parser.add_argument("--project", default="blocktrain", help="logging.wandb_project")
    parser.add_argument("--name", default="blocktrain", help="the workspace's name")
    parser.add_argument("--save", action="store_true", help="create it in W&B (needs a login)")
    args = parser.parse_args(argv)
    try:
        workspace = build(args.entity, args.project, args.name)
    except ImportError:
        print("error: the workspace needs wandb-workspaces: pip install 'blocktrain[wandb]'",
              file=sys.stderr)
        return 2
    for section in workspace.sections:
        titles = ", ".join(getattr(p, "title", None) or getattr(p, "table_name", "?")
                           for p in section.panels)
        print(f"{section.name}: {titles}")
    if args.save:
        try:
            saved = workspace.save()
        except Exception as exc:  # no login, no network, no such entity
            print(f"error: --save: W&B refused the workspace ({exc}); check `wandb login` and "
                  "--entity", file=sys.stderr)
            return 2
        print(f"saved: {saved.url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
