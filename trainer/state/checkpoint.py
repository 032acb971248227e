"""Training-state checkpoints: sharded model and optimizer (DCP), the rest as data, committed atomically.

One checkpoint is a folder `<root>/step_<N>`:
    *.distcp, .metadata     model + optimizer state, each rank writing its own shards (DCP)
    rng/rank<r>.pt          rank r's CPU (and CUDA) generator states, plain tensors
    state.json              step, data position, tokens seen, LR schedule, W&B run id, the config
    COMMITTED.json          written last, by rank 0, once every rank's files are on disk: the
                            name, size and CRC-32 of every file
A folder without its commit marker is torn (killed while saving) and never loaded; one whose files
do not match the marker is corrupt and is skipped with a warning naming it. Older committed
checkpoints are deleted only after a newer one is committed, so the last good one always exists.
Nothing unknown is unpickled: DCP's `.metadata` goes through an unpickler that admits only its
own types (trainer/state/meta.py), `torch.load(weights_only=True)` reads the RNG states.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from trainer.state.integrity import (COMMIT, STATE, Damaged, manifest, read_rng, read_state,
                                     verify)
from trainer.state.save_errors import looks_full, save_failure, was_interrupted

__all__ = ["COMMIT", "STATE", "Checkpointer", "CheckpointError", "verify"]

log = logging.getLogger("trainer")

_NAME = re.compile(r"^step_(\d{8})$")


def _dcp() -> Any:
    """torch.distributed.checkpoint, imported at the first save or load and not at start-up:
    3.0 MiB a process held through training and 35 ms before the first step (measured
    2026-12-02), in every run, most of which save only after many steps."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict  # noqa: F401  (dcp.state_dict below)
    return dcp


def _failures() -> tuple[type, ...]:
    """What a failed save or load raises: DCP's CheckpointException is a BaseException."""
    return (Exception, _dcp().api.CheckpointException)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names it and what to change."""


def checkpoint_path(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:08d}")


def list_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, path) of every checkpoint folder under root, committed or not, newest first."""
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), os.path.join(root, name))
             for name in os.listdir(root) if (m := _NAME.match(name))]
    return sorted(found, reverse=True)


def _own_files(folder: str, rank: int) -> list[str]:
    """The files rank `rank` wrote: its DCP shards (named by rank) and its RNG file."""
    names = [n for n in os.listdir(folder) if n.startswith(f"__{rank}_") and n.endswith(".distcp")]
    return sorted(names) + [f"rng/rank{rank}.pt"]


def write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    directory = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a crash
    finally:
        os.close(directory)


# Written to the run directory when a run stops early after a committed save (preemption signal,
# train.stop_at_step), removed when a run completes. Launchers read it: the Slurm job script
# requeues the job when it appears (torchrun reports any non-zero worker exit as its own failure,
# so the exit status alone cannot say "saved; start me again").
STOPPED_MARKER = "preempted.json"


def mark_stopped(run_dir: str, step: int, reason: str, exit_code: int) -> None:
    write_atomic(os.path.join(run_dir, STOPPED_MARKER),
                 json.dumps({"step": step, "reason": reason, "exit_code": exit_code}) + "\n")


def clear_stopped(run_dir: str) -> None:
    try:
        os.remove(os.path.join(run_dir, STOPPED_MARKER))
    except FileNotFoundError:
        pass


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


@dataclass
class Loaded:
    """What a load restored besides model and optimizer."""

    path: str
    state: dict[str, Any]  # the contents of state.json
    rng_restored: bool  # False: this rank had no saved generator state (world size changed)


class Checkpointer:
    """Saves and loads training state under `root`; one per run, on every rank.

    keep: committed checkpoints kept (>= 1). async_save: the write runs in a thread after the
    state is copied to CPU memory; it is committed at the first step boundary after every rank
    finished (see `poll`). Collectives of saving run on their own gloo group, so a background
    write never interleaves with training's collectives.
    """

    def __init__(self, root: str, keep: int, async_save: bool, rank: int, world_size: int,
                 device: torch.device, model_settings: Optional[dict] = None) -> None:
        self.root, self.keep, self.async_save = root, keep, async_save
        self.model_settings = model_settings or {}  # to name what changed when shapes differ
        self.rank, self.world_size, self.device = rank, world_size, device
        # Made now, not at the first save: making a group needs the rendezvous store, which
        # dies with the torchrun agent, and a save must still work after that (a stop).
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._pending: Optional[tuple[int, str, Future]] = None
        self._files: Optional[dict[str, list[int]]] = None  # this rank's, once written
        self.last_committed: Optional[int] = None
        if rank == 0:
            os.makedirs(root, exist_ok=True)

    # --- saving ------------------------------------------------------------------------------

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
             state: dict[str, Any]) -> None:
        """Start saving the state after `step` (every rank). Waits for a previous async save.
        A failed write (a full disk) removes the torn folder and raises SaveFailed on every
        rank; the committed checkpoints are untouched."""
        self.wait()
        folder = checkpoint_path(self.root, step)
        if self.rank == 0 and os.path.exists(folder):  # a torn try at this step, or a rollback
            shutil.rmtree(folder)
        self._barrier()
        try:
            self._save(step, folder, model, optimizer, state)
        except BaseException as error:  # DCP's CheckpointException is a BaseException
            self._pending = None
            if was_interrupted(error):  # a second Ctrl-C: stop at once, as asked
                if self.rank == 0:  # not waiting for the others: they may be stopping too
                    shutil.rmtree(folder, ignore_errors=True)
                raise KeyboardInterrupt from None
            if not isinstance(error, _failures()):
                raise
            raise self._failed(error, step, folder) from None

    def _save(self, step: int, folder: str, model: nn.Module, optimizer: torch.optim.Optimizer,
              state: dict[str, Any]) -> None:
        dcp = _dcp()
        model_state, optim_state = dcp.state_dict.get_state_dict(model, optimizer)
        tensors = {"model": model_state, "optim": optim_state}
        problem = None
        try:  # the small files first; every rank must learn if one of them failed
            os.makedirs(os.path.join(folder, "rng"), exist_ok=True)
            torch.save(_rng_state(self.device),
                       os.path.join(folder, "rng", f"rank{self.rank}.pt"))
            if self.rank == 0:
                with open(os.path.join(folder, STATE), "w") as f:
                    json.dump(state, f, indent=1, sort_keys=True)
        except OSError as error:
            problem = error
        problems = [p for p in self._gather_list(problem) if p is not None]
        if problems:
            raise problems[0]
        self._files = None
        if self.async_save:
            future = dcp.async_save(tensors, checkpoint_id=folder, process_group=self.group)
            future.add_done_callback(lambda done: self._hash_own(folder, done))
            self._pending = (step, folder, future)
            return
        dcp.save(tensors, checkpoint_id=folder, process_group=self.group,
                 no_dist=self.group is None)
        self._hash_own(folder, None)
        self._pending = (step, folder, None)
        self._commit()

    def _hash_own(self, folder: str, done: Optional[Future]) -> None:
        # On the writer thread for async saves: hashing is I/O, keep it off the training thread.
        if done is not None and done.exception() is not None:
            return
        self._files = manifest(folder, _own_files(folder, self.rank))

    def local_done(self) -> bool:
        """This rank has nothing pending, or its pending write finished (for the step's vote)."""
        if self._pending is None:
            return True
        future = self._pending[2]
        return future is None or future.done()

    def poll(self, all_done: bool) -> None:
        """At a step boundary, with the vote of all ranks: commit a finished async save."""
        if self._pending is not None and all_done:
            self._commit()

    def wait(self) -> None:
        """Finish and commit a pending save (every rank)."""
        if self._pending is not None:
            future = self._pending[2]
            if future is not None:
                future.result()
            self._commit()

    def _commit(self) -> None:
        step, folder, future = self._pending
        self._pending = None
        if future is not None:
            try:
                future.result()  # raises here if this rank's write failed
            except _failures() as error:
                raise self._failed(error, step, folder) from None
        files = self._gather(self._files or {})
        if self.rank == 0:
            files.update(manifest(folder, [".metadata", STATE]))
            write_atomic(os.path.join(folder, COMMIT),
                          json.dumps({"step": step, "world_size": self.world_size,
                                      "files": files}, indent=1, sort_keys=True))
            self._retain(step)
        self.last_committed = step
        self._barrier()

    def _retain(self, newest: int) -> None:
        """Keep the newest `keep` committed checkpoints; drop older and torn ones."""
        kept = 0
        for step, path in list_checkpoints(self.root):
            committed = os.path.exists(os.path.join(path, COMMIT))
            if step > newest:
                continue  # e.g. left by a run that went further before a rollback
            if committed and kept < self.keep:
                kept += 1
                continue
            shutil.rmtree(path, ignore_errors=True)

    # --- loading -----------------------------------------------------------------------------

    def load_latest(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                    refuse_if_all_damaged: bool = False) -> Optional[Loaded]:
        """Load the newest intact committed checkpoint into model and optimizer (every rank).

        refuse_if_all_damaged: when checkpoints were committed but none is intact, raise
        instead of returning None: starting again from step 0 would silently repeat the history
        (resume); a rollback has its own answer to "nothing to go back to".
        """
        choice: list = [None, None]
        if self.rank == 0:
            damaged = []
            for step, path in list_checkpoints(self.root):
                problem = verify(path)
                if problem is None:
                    choice[0] = path
                    break
                log.warning("checkpoint %s skipped: %s", path, problem)
                damaged.append((path, problem))
            committed = [p for p, _ in damaged if os.path.exists(os.path.join(p, COMMIT))]
            if choice[0] is None and committed and refuse_if_all_damaged:
                choice[1] = (f"every checkpoint in {self.root} is damaged (" + "; ".join(
                    f"{os.path.basename(p)}: {why}" for p, why in damaged) + "); to start over "
                    "deliberately, set save.resume=false (they are moved aside, not deleted)")
        if self.group is not None:
            dist.broadcast_object_list(choice, src=0, group=self.group)
        if choice[1] is not None:
            raise CheckpointError(choice[1])
        if choice[0] is None:
            return None
        return self.load(choice[0], model, optimizer)

    def load(self, folder: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> Loaded:
        from trainer.state.meta import SafeReader, UnsafeMetadata, shape_mismatches
        dcp = _dcp()
        model_state, optim_state = dcp.state_dict.get_state_dict(model, optimizer)
        tensors = {"model": model_state, "optim": optim_state}
        reader = SafeReader(folder)
        try:
            metadata = reader.read_metadata()
        except UnsafeMetadata as error:
            raise CheckpointError(f"{error}. Use a checkpoint from a trusted source") from None
        self._same_lora(folder)
        mismatches = shape_mismatches(metadata, model_state)
        if mismatches:
            raise CheckpointError(self._another_model(folder, mismatches))
        try:
            dcp.load(tensors, storage_reader=reader, process_group=self.group,
                     no_dist=self.group is None)
        except _failures() as error:
            first = str(error).strip().splitlines()[-1][:300]
            raise CheckpointError(
                f"checkpoint {folder} does not fit this model or optimizer ({first}); restore "
                "the config it was saved with, or start over with save.resume=false") from None
        dcp.state_dict.set_state_dict(model, optimizer, model_state_dict=tensors["model"],
                                      optim_state_dict=tensors["optim"])
        rng_name = f"rng/rank{self.rank}.pt"
        rng_restored = os.path.exists(os.path.join(folder, rng_name))
        try:  # checked by verify on rank 0 already; this rank may see another file system
            state = read_state(folder)
            if rng_restored:
                _set_rng_state(read_rng(folder, rng_name), self.device)
        except Damaged as error:
            raise CheckpointError(f"checkpoint {folder}: {error}") from None
        step = int(os.path.basename(folder)[len("step_"):])
        self.last_committed = step
        return Loaded(folder, state, rng_restored)

    def _same_lora(self, folder: str) -> None:
        """Other adapters (model.lora) than were trained are another run, even where every
        shape fits (alpha, dropout): refused in one line."""
        from trainer.config import ConfigError
        from trainer.models.families.lora_settings import lora_changes

        with open(os.path.join(folder, STATE)) as f:  # a bare test state may say nothing
            saved = json.load(f).get("config", {}).get("model", {}).get("lora")
        changed = lora_changes(saved, self.model_settings.get("lora"))
        if changed:  # named by the first setting that changed: the one to set back
            key, rest = changed[0].split(" ", 1)
            raise ConfigError(key, f"{', '.join([rest, *changed[1:]])} since the save of "
                              f"{folder}, which trained other adapters; set it back to "
                              "resume, or start over with save.resume=false")

    def _another_model(self, folder: str, mismatches: list[str]) -> str:
        """Which parameters differ, and which model.* settings changed since the save."""
        changed = []
        try:
            with open(os.path.join(folder, STATE)) as f:
                saved = json.load(f)["config"]["model"]
            changed = [f"model.{k} {saved.get(k)!r} -> {v!r}" for k, v in
                       sorted(self.model_settings.items()) if saved.get(k) != v]
        except (OSError, ValueError, KeyError):
            pass
        more = f" (and {len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
        settings = f"; changed since the save: {', '.join(changed)}" if changed else ""
        return (f"checkpoint {folder} holds another model: {mismatches[0]}{more}{settings}; "
                "set them back to resume, or start over with save.resume=false")

    def _failed(self, error: BaseException, step: int, folder: str) -> Exception:
        """Remove the torn folder (once every rank is done with it); the one-line error."""
        full = looks_full(folder)
        self._barrier()
        if self.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
        return save_failure(error, step, folder, self.last_committed, full)

    def _gather_list(self, item: Any) -> list[Any]:
        if self.group is None:
            return [item]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, item, group=self.group)
        return gathered

    def _gather(self, files: dict[str, list[int]]) -> dict[str, list[int]]:
        if self.group is None:
            return dict(files)
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, files, group=self.group)
        merged: dict[str, list[int]] = {}
        for part in gathered:
            merged.update(part)
        return merged

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def close(self) -> None:
        """Finish a pending save; called at the end of a run (also a failed one: best effort)."""
        self.wait()
