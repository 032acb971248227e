"""Weights & Biases, rank 0 only, never in the way of training.

wandb is imported only here and only when `logging.wandb=true`, so hosts without it still train.
Online when the user is logged in, offline otherwise; the run id is kept in the run directory so
a restarted run continues the same W&B run. Init runs in a thread with a deadline: a hung or
failing W&B costs a warning, not the job.
"""

from __future__ import annotations

import logging
import netrc
import os
import threading
import uuid
from typing import Any, Optional

from trainer.state.ownership import RUN_ID_FILE, WANDB_STEP_FILE

log = logging.getLogger(__name__)


def _logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _call_with_deadline(fn, timeout_s: float) -> tuple[bool, Any]:
    """(finished, result); the call keeps running in a daemon thread if it misses the deadline."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except Exception as exc:  # W&B failures of any kind must not stop training
            box["error"] = exc

    thread = threading.Thread(target=target, name="wandb-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return False, None
    if "error" in box:
        raise box["error"]
    return True, box.get("result")


def _read_step(path: Optional[str]) -> int:
    try:
        with open(path) as f:  # type: ignore[arg-type]
            return int(f.read().strip())
    except (TypeError, OSError, ValueError):
        return -1


class WandbLogger:
    def __init__(self, run: Any, offline: bool = False, step_file: Optional[str] = None):
        self.run = run
        self.offline = offline
        self.run_dir = getattr(run, "dir", None)  # <run dir>/wandb/<offline-run-...>/files
        self._step_file = step_file
        self._last = _read_step(step_file)  # the highest step any start logged (-1: none)
        self._offset: Optional[int] = None  # decided at the first step this start logs

    def _at(self, step: int) -> int:
        """The W&B step for the run's own step (batches read): W&B keeps only growing steps
        in a run, and drops the rest. A start that replays steps an earlier one logged (a
        resume from an earlier checkpoint) logs them after those, shifted by a constant;
        `opt_step` still says which optimizer step each point is."""
        if self._offset is None:
            self._offset = max(0, self._last + 1 - step)
            if self._offset:
                log.info("W&B: this start replays steps an earlier one logged; its points "
                         "come after those (W&B step = batches read + %d; opt_step is the "
                         "optimizer step)", self._offset)
        step += self._offset
        if step > self._last and self._step_file:
            self._last = step
            try:
                with open(self._step_file, "w") as f:
                    f.write(str(step))
            except OSError:
                pass  # only a later replay's placement depends on it
        return step

    @classmethod
    def start(cls, run_dir: str, config: dict, project: str, entity: Optional[str],
              run_name: str, timeout_s: float, group: Optional[str] = None,
              tags: Optional[list[str]] = None) -> Optional["WandbLogger"]:
        try:
            import wandb
        except ImportError:
            log.warning("logging.wandb=true but wandb is not installed (pip install wandb); "
                        "continuing without it, set logging.wandb=false to silence this")
            return None
        id_path = os.path.join(run_dir, RUN_ID_FILE)
        if os.path.exists(id_path):
            with open(id_path) as f:
                run_id = f.read().strip()
        else:
            run_id = uuid.uuid4().hex[:12]
        mode = os.environ.get("WANDB_MODE") or ("online" if _logged_in() else "offline")

        def init():
            return wandb.init(project=project, entity=entity, name=run_name, id=run_id,
                              resume="allow", dir=run_dir, config=config, mode=mode,
                              group=group, job_type="train", tags=tags or None,
                              settings=wandb.Settings(init_timeout=timeout_s, silent=True))
        try:
            finished, run = _call_with_deadline(init, timeout_s + 5)
        except Exception as exc:
            log.warning("W&B init failed (%s); continuing without W&B", exc)
            return None
        if not finished or run is None:
            log.warning("W&B init did not finish in %.0fs; continuing without W&B "
                        "(logging.wandb_init_timeout_s)", timeout_s)
            return None
        with open(id_path, "w") as f:
            f.write(run_id)
        log.info("W&B %s run %s in %s", mode, run_id, run_dir)
        return cls(run, offline=mode == "offline",
                   step_file=os.path.join(run_dir, WANDB_STEP_FILE))

    def sync_command(self) -> Optional[str]:
        """For an offline run: the command that uploads it, every start of it (each start, e.g.
        each requeue of a Slurm job, writes its own offline-run-* folder under the same run id,
        and `wandb sync` uploads folders of one id in order of start time, as one run)."""
        if not self.offline or not self.run_dir:
            return None
        folder = os.path.dirname(os.path.normpath(self.run_dir))  # <run dir>/wandb/offline-run-..
        run_id = getattr(self.run, "id", None)
        return (f"wandb sync {os.path.dirname(folder)}/offline-run-*"
                + (f" --id {run_id}" if run_id else ""))

    def log(self, metrics: dict, step: int) -> None:
        try:
            self.run.log(metrics, step=self._at(step))
        except Exception as exc:
            log.warning("W&B log failed (%s); disabling W&B for this run", exc)
            self.run = None

    def alert(self, title: str, text: str, level: str) -> None:
        """A W&B alert: sent by e-mail/Slack when online; offline it stays in the run file and
        goes with `wandb sync`."""
        if self.run is None:
            return
        try:
            self.run.alert(title=title, text=text, level=level, wait_duration=1)
        except Exception as exc:
            log.warning("W&B alert failed (%s)", exc)

    def summary(self, fields: dict) -> None:
        if self.run is None:
            return
        try:
            self.run.summary.update(fields)
        except Exception as exc:
            log.warning("W&B summary failed (%s)", exc)

    def log_media(self, fields: dict, step: int = 0) -> None:
        """Tables and images: `fields` maps keys to ("table", rows) or ("image", path)."""
        if self.run is None:
            return
        try:
            import wandb

            logged = {}
            for key, (kind, value) in fields.items():
                if kind == "image":
                    logged[key] = wandb.Image(value)
                elif value:
                    columns = list(value[0])
                    logged[key] = wandb.Table(columns=columns,
                                              data=[[r.get(c) for c in columns] for r in value])
            self.run.log(logged, step=self._at(step))
        except Exception as exc:
            log.warning("W&B media %s failed (%s)", ", ".join(fields), exc)

    def checkpoint_reference(self, path: str, step: int) -> None:
        """The checkpoint folder as an artifact *by reference*: W&B records where it is and
        its files' sizes, and uploads nothing."""
        if self.run is None:
            return
        try:
            import wandb

            artifact = wandb.Artifact(f"checkpoint-{self.run.id}", type="checkpoint",
                                      metadata={"step": step, "path": path})
            artifact.add_reference(f"file://{path}", checksum=False)
            self.run.log_artifact(artifact, aliases=["latest", f"step-{step}"])
        except Exception as exc:
            log.warning("W&B checkpoint reference failed (%s)", exc)

    def log_table(self, key: str, rows: list[dict], step: int = 0) -> None:
        if self.run is None or not rows:
            return
        try:
            import wandb

            columns = list(rows[0])
            self.run.log({key: wandb.Table(columns=columns,
                                           data=[[r[c] for c in columns] for r in rows])},
                         step=self._at(step))
        except Exception as exc:
            log.warning("W&B table %s failed (%s)", key, exc)

    def finish(self, timeout_s: float = 60.0) -> None:
        if self.run is None:
            return
        try:
            finished, _ = _call_with_deadline(self.run.finish, timeout_s)
            if not finished:
                log.warning("W&B did not finish syncing in %.0fs; data stays in the run dir",
                            timeout_s)
        except Exception as exc:
            log.warning("W&B finish failed (%s)", exc)
