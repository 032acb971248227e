"""Where a run stands (`Progress`), what a checkpoint records of it, and getting back there at
start (resume; going back mid-run is trainer/state/rollback.py).

The data position is one number, the index of the next global batch: every rank derives its share
of a global batch from it (trainer/data/tokens.py), and a global batch does not depend on how it is split
over ranks and micro-batches. So a checkpoint written by 2 ranks resumes on 1 (or 4) reading
exactly the data the original run would have read, as long as the global batch size and the
sequence length are unchanged. What does change with the world size is dropout: each rank has its
own generator, and a rank that did not exist when the checkpoint was written starts a fresh one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from trainer.config import Config
from trainer.data.batches import Data
from sharding.layout import Layout
from trainer.state.checkpoint import Checkpointer, Loaded
from trainer.state.ownership import RUN_ID_FILE

log = logging.getLogger("trainer")


@dataclass
class Progress:
    step: int = 0  # optimizer steps applied
    batch_index: int = 0  # global batches read so far, skipped and rolled-back ones included
    tokens_seen: int = 0  # tokens of the applied steps
    skipped_steps: int = 0
    rollbacks: int = 0


@dataclass(frozen=True)
class ModelState:
    """The model with its optimizer and learning-rate schedule: what a step updates, a
    checkpoint saves, and a resume or a rollback restores."""
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any


@dataclass(frozen=True)
class RunRecord:
    """What every checkpoint of a run records beside the model and optimizer."""
    layout: Layout
    cfg: Config
    run_dir: str
    data: Optional[Data] = None  # records the identity of what it reads

    def state(self, progress: Progress, scheduler) -> dict[str, Any]:
        """Everything but model and optimizer that a checkpoint holds (JSON)."""
        wandb_id = None
        id_file = os.path.join(self.run_dir, RUN_ID_FILE)
        if os.path.exists(id_file):
            with open(id_file) as f:
                wandb_id = f.read().strip()
        return {"progress": dataclasses.asdict(progress), "scheduler": scheduler.state_dict(),
                "world_size": self.layout.world_size,
                "global_batch_size": self.layout.global_batch_size,
                "sequence": self.layout.degree, "context": self.layout.context,
                "seq_len": self.cfg.data.seq_len, "data_seed": self.cfg.train.seed,
                "wandb_run_id": wandb_id, "config": dataclasses.asdict(self.cfg),
                "data": None if self.data is None else self.data.record(),
                "val_samples": None if self.data is None else self.data.val_samples}


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else key))
    return out


DATA_CHANGES = "data_changes.json"  # in the run directory: every change of data gone on with


def _record_change(run_dir: str, progress: Progress, note: str, saved: Optional[dict],
                   now: Optional[dict]) -> None:
    """Append this change to the run directory's DATA_CHANGES (a JSON list)."""
    import json
    import time

    from trainer.state.checkpoint import write_atomic

    path = os.path.join(run_dir, DATA_CHANGES)
    events = []
    if os.path.exists(path):
        with open(path) as f:
            events = json.load(f)
    events.append({"step": progress.step, "batch_index": progress.batch_index,
                   "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "change": note,
                   "before": (saved or {}).get("identity"), "after": (now or {}).get("identity")})
    write_atomic(path, json.dumps(events, indent=1) + "\n")


def restore(loaded: Loaded, scheduler) -> Progress:
    scheduler.load_state_dict(loaded.state["scheduler"])
    return Progress(**loaded.state["progress"])


def resume(checkpointer: Checkpointer, model: ModelState, layout: Layout, cfg: Config,
           rank: int, data: Data, run_dir: str) -> Optional[tuple[Progress, str]]:
    """Load the newest intact checkpoint, if any: (progress, one line saying what happened).
    The data refuses a checkpoint it cannot continue from, and data other than what the
    checkpoint was trained on unless data.on_change says to go on (written to DATA_CHANGES)."""
    loaded = checkpointer.load_latest(model.model, model.optimizer, refuse_if_all_damaged=True)
    if loaded is None:
        return None
    state = loaded.state
    # Ranks that shared each sample then (sequence x context): any (N', M') and world size
    # resume, the parameters and optimizer state being whole-model (resharded on load).
    saved_share = state.get("sequence", 1) * state.get("context", 1)
    data.check_resume(state["world_size"], state["global_batch_size"], saved_share)
    progress = restore(loaded, model.scheduler)
    notes = [f"resumed from {loaded.path} (step {progress.step}, batch {progress.batch_index})"]
    changed_data = data.continue_from(state.get("data"), cfg.data.on_change,
                                      progress.batch_index, progress.step)
    if changed_data is not None:
        notes.append(changed_data)
        if rank == 0:
            _record_change(run_dir, progress, changed_data, state.get("data"), data.record())
    if not loaded.rng_restored:
        # Deterministic, but not what an uninterrupted run would have drawn.
        torch.manual_seed(cfg.train.seed + rank + 1_000_003 * progress.step)
    same_batches = (state["global_batch_size"], state["seq_len"]) == (layout.global_batch_size,
                                                                      cfg.data.seq_len)
    if state["world_size"] != layout.world_size:
        # The data order is said once: unchanged here, or "differs" in the note below.
        order = "the data order is unchanged, " if same_batches else ""
        notes.append(f"saved by {state['world_size']} ranks, resumed on {layout.world_size}: "
                     f"model and optimizer are exact, {order}dropout masks differ from an "
                     "uninterrupted run")
    if not same_batches:
        notes.append(f"global batch {state['global_batch_size']} x {state['seq_len']} tokens "
                     f"became {layout.global_batch_size} x {cfg.data.seq_len}: the data order "
                     "from here differs from the original run's")
    note = _same_validation(state, cfg, data)
    if note is not None:
        notes.append(note)
    saved, now = _flat(state["config"]), _flat(dataclasses.asdict(cfg))
    changed = sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k))
    if changed:
        notes.append("config changed since the save: " + ", ".join(
            f"{k}={saved.get(k)!r}->{now.get(k)!r}" for k in changed))
    return progress, "; ".join(notes)


def _same_validation(state: dict, cfg: Config, data: Data) -> Optional[str]:
    """Score the validation samples the checkpoint's run scored (trainer/data/validation.py),
    whatever the world size, degree and micro-batch now, so val_loss goes on; a line where
    that is not so: train.eval_batches changed (a new set asked for), or the checkpoint does
    not say its set (saved before it was recorded, with an unresolved micro-batch)."""
    was = state.get("val_samples") or _val_samples(
        state["config"], state["world_size"], state.get("sequence", 1) * state.get("context", 1))
    asked = state["config"].get("train", {}).get("eval_batches")
    if was is None or asked != cfg.train.eval_batches:
        if was is None or was == data.val_samples:
            return None
        return (f"validation is {data.val_samples} samples now, {was} before (train.eval_batches "
                "changed): val_loss from here is not comparable with the values before")
    if was != data.val_samples:
        data.keep_validation(was)
    return None


def _val_samples(config: dict, world_size: int, sequence: int) -> Optional[int]:
    """How many samples a checkpoint's validation set held, for one saved before it recorded
    it: each data-parallel group scored eval_batches micro-batches; None where unresolved."""
    train = config.get("train", {})
    micro, batches = train.get("micro_batch_size"), train.get("eval_batches")
    if not isinstance(micro, int) or not isinstance(batches, int):
        return None
    return batches * micro * (world_size // max(1, sequence))
