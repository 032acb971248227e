"""`python -m trainer [group=option ...] [key=value ...]`: the same entry under torchrun.

The command line is composed and validated first (trainer/cli.py): a mistake is one line from
rank 0 and exit status 2, before torch is imported. A single run then starts from that same
composition (`cli.single_run`: run directory, config dump, train.log, as Hydra sets them up);
`-m` sweeps and Hydra's own flags go through `@hydra.main`.
"""

from __future__ import annotations

import os
import signal
import sys


def _interrupted_at_once(signum, frame) -> None:
    """Ctrl-C outside the training loop (whose own handler saves first: trainer/faults.py): stop
    at once with a line. Not a KeyboardInterrupt: start-up is mostly imports (Hydra's, torch's,
    numpy's lazy ones while the data is read), and one raised inside an import comes out as a
    trace, a RecursionError or an ImportError, or is swallowed by an optional import's
    `except ImportError`. Nothing is half-written here: files are replaced whole, and the
    tokenizer's cache handles its own signals (trainer/data/interrupt.py)."""
    os.write(2, b"\ninterrupted: stopped at once, without saving; the checkpoints written so "
                b"far are kept\n")
    os._exit(130)


def _stopped_at_once(signum, frame) -> None:
    """SIGTERM, or a `save.signal` (SIGUSR1 by default: Slurm's warning before the time limit),
    outside the training loop: before training there is nothing to save, so stop with the
    preemption status (start the same run again) and one line (rank 0), not the signal's
    default action (no word, status 143 or 138)."""
    if os.environ.get("RANK", "0") == "0":
        os.write(2, f"stopped by {signal.Signals(signum).name} before training started: "
                    "nothing to save; start the same run again\n".encode())
    os._exit(75)  # trainer/data/interrupt.py's STOPPED_EXIT, save.preempt_exit_code's default


# From the first line, before the imports a signal would otherwise interrupt. A process started
# with Ctrl-C ignored (a shell's background job, nohup) keeps ignoring it.
if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
    signal.signal(signal.SIGINT, _interrupted_at_once)
for _name in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP"):  # SIGTERM and save.signal's choices
    if signal.getsignal(getattr(signal, _name)) is not signal.SIG_IGN:
        signal.signal(getattr(signal, _name), _stopped_at_once)

import hydra  # noqa: E402  (after the handler: these imports are what a Ctrl-C interrupts)
from omegaconf import DictConfig

from trainer import cli
from trainer.config import ConfigError, register_schema
from trainer.state.rundir import register_resolver


@hydra.main(config_path="pkg://conf", config_name="config", version_base=None)
def _hydra_run(cfg: DictConfig) -> None:
    """Hydra's own run: `-m` sweeps (each job composed by Hydra) and Hydra's flags."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    _job(cfg, hydra_cfg.runtime.output_dir, multirun=hydra_cfg.mode == RunMode.MULTIRUN)


def _job(cfg: DictConfig, run_dir: str, multirun: bool) -> None:
    """One training job in `run_dir`; exits with its status where that is not 0."""
    try:
        config = cli.to_config(cfg)
        _, world, nodes = cli.world_from_env(os.environ)
        layout = cli.validate(config, world_size=world, num_nodes=nodes)
    except ConfigError as exc:  # reached by `-m` sweeps, which skip the pre-flight check
        cli.print_error(exc)
        cli.exit_after_error()

    from checkpointing.planner.policies import BudgetError
    from offload.engine import OffloadError
    from trainer.loop import train
    from trainer.faults import CollectiveFailure, FaultLimit
    from trainer.preflight.precheck import as_config_error, setting_of
    from trainer.state.ownership import RunDirBusy
    from trainer.state.save_errors import SAVE_FAILED_EXIT, SaveFailed
    from trainer.state.checkpoint import CheckpointError
    from trainer.data.cache_files import CacheFull
    from trainer.data.interrupt import PrepareStopped

    try:
        status = train(config, layout, run_dir=run_dir, keep_process_group=multirun)
    except (BudgetError, ConfigError, CheckpointError, RunDirBusy, ValueError) as exc:
        # Configuration mistakes known only once the run is under way: status 2. BudgetError:
        # after profiling on the device; ConfigError: once the model is built (model.freeze);
        # CheckpointError: once a checkpoint meets the built model; RunDirBusy: another live
        # run holds the directory; ValueError: our own messages start with the setting.
        key = {BudgetError: "checkpointing.budget", CheckpointError: "save.resume",
               RunDirBusy: getattr(exc, "setting", None)}.get(type(exc))
        if _debug() or (type(exc) is ValueError and setting_of(str(exc)) is None):
            raise
        error = exc if isinstance(exc, ConfigError) else (
            ConfigError(key, str(exc)) if key else as_config_error(exc))
        _fail(f"error: {str(error).removeprefix('config: ')}", 2)
    except (CollectiveFailure, FaultLimit, OffloadError) as exc:
        # Names the rank and the operation, or the setting and what happened: the trace adds
        # nothing. Not a configuration mistake, so not status 2.
        if _debug():
            raise
        _fail(f"error: {exc}", 1, every_rank=isinstance(exc, CollectiveFailure))
    except SaveFailed as exc:  # a full disk: the committed checkpoints are intact
        if _debug():
            raise
        _fail(f"error: save.dir: {exc}", SAVE_FAILED_EXIT)
    except CacheFull as exc:  # a full data.cache_dir: nothing half-written was kept
        if _debug():
            raise
        _fail(f"error: data.cache_dir: {exc.strerror}", SAVE_FAILED_EXIT)
    except PrepareStopped as exc:  # a signal while tokenizing: nothing half-written was kept
        _fail(str(exc), exc.status)
    if status:
        sys.exit(status)  # preempted after saving: the launcher may run it again


def _fail(line: str, status: int, every_rank: bool = False) -> None:
    """One line on the console (rank 0, or every rank where each has its own to say) and in
    train.log, then exit; other ranks leave a moment later (see cli.exit_after_error)."""
    import logging

    rank = cli.world_from_env(os.environ)[0]
    if rank == 0 or every_rank:
        print(line, file=sys.stderr, flush=True)
        for handler in logging.getLogger().handlers:  # Hydra's train.log handler
            if isinstance(handler, logging.FileHandler):
                handler.emit(logging.makeLogRecord({"name": "trainer", "levelno": logging.ERROR,
                                                    "levelname": "ERROR", "msg": line}))
    if status == 2:
        cli.exit_after_error()
    sys.exit(status)


def _debug() -> bool:
    """HYDRA_FULL_ERROR=1 asks for the whole traceback, as it does for Hydra's own errors."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def _claim_run_dir(argv: list[str]) -> None:
    """Rank 0 locks the run directory before Hydra writes its .hydra/ files and train.log
    there: a run refused because another holds the directory writes nothing into it."""
    if cli.world_from_env(os.environ)[0] != 0:
        return
    located = cli.run_dir_of(argv)
    if located is None:
        return
    from trainer.state.ownership import RunDirBusy, claim

    try:
        claim(*located)
    except RunDirBusy as exc:
        print(f"error: {exc.setting}: {exc}", file=sys.stderr, flush=True)
        cli.exit_after_error()


def _exit_now(status: int) -> None:
    """Exit without the interpreter's teardown: collecting a trained model's objects takes a
    second or more, which a second Ctrl-C asked not to wait for. Exit handlers (W&B's among
    them) still run, and every file is flushed first."""
    import atexit
    import logging

    logging.shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main() -> None:
    argv = sys.argv[1:]
    try:
        if cli.check_command(argv):
            cli.exit_after_error()
        register_schema()
        register_resolver()
        _claim_run_dir(argv)
        single = cli.single_run(argv)  # one composition: the pre-flight check's
        if single is not None:
            _job(*single, multirun=False)
        else:
            if any(a in cli._HELP_FLAGS for a in argv):  # ours first, then Hydra's
                print(cli.HELP)
            sys.argv = [sys.argv[0]] + cli.hydra_argv(argv)
            _hydra_run()
    except KeyboardInterrupt:  # Ctrl-C twice, or before training started
        if _debug():
            raise
        if cli.world_from_env(os.environ)[0] == 0:
            print("\ninterrupted: stopped at once, without saving; the checkpoints written so "
                  "far are kept", file=sys.stderr, flush=True)
        _exit_now(130)
    if "torch.distributed" in sys.modules:  # a sweep kept its process group for all its jobs
        from trainer.distenv import shutdown

        shutdown()


if __name__ == "__main__":
    try:
        main()
    except SystemExit as exc:  # the statuses of _job and the checks
        code = exc.code
        if isinstance(code, str):
            print(code, file=sys.stderr)
        _exit_now(code if isinstance(code, int) else 0 if code is None else 1)
    # Not into the interpreter's teardown: it puts every signal back to its default action
    # first, so a Ctrl-C in the second or more it takes ended the run by SIGINT (status -2,
    # no line) after it had finished.
    _exit_now(0)
