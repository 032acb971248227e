"""`python -m launch.run [torchrun's options] -m trainer [overrides]`, or `blocktrain-run`:
torchrun, stopping the way a training run needs.

The options are torchrun's own (its parser), and so are the rendezvous, the agent and the worker
processes; only these differ:

- Ctrl-C (SIGINT), SIGTERM, SIGUSR1 and SIGUSR2 (the trainer's `save.signal` choices, and the
  one a `save.signal=` override names) are passed to the workers, which finish their step, save
  and exit, and the agent waits for that however long it takes; the launcher's status is
  theirs. Before any worker started, a stop signal ends the launcher (130 for Ctrl-C, else 75)
  with one line; a worker whose interpreter is still starting gets it once its entry handles it
  (launch/worker_signals.py). torchrun's agent SIGKILLs them once its
  `--shutdown-timeout` (30 s) runs out, mid-step or mid-save on a large model.
- A second Ctrl-C stops them at once: passed on again (each worker's own stop at once: a torn save
  removed, one line), then SIGKILL for any still running STOP_AT_ONCE_S later (one blocked in a
  collective cannot act on a signal before it returns). torchrun's workers run in their own
  sessions, so only what the agent passes on reaches them.
- The exit status is the workers' own: 0, 130 (Ctrl-C), 75 (saved and stopped), 74 (a save
  failed), 2 (a setting), 1; nothing is printed besides their lines, except one line for a worker
  killed by a signal (it could say nothing itself; exit 1, also where its peers then stopped
  with 75: a requeue would loop on a kill), and a last line for a group stopped with 75 by a
  signal passed on (rank 0's own line may be missing, or followed by a peer's C++ error). A
  worker ended by the very signal this launcher passed on (it came before the worker's Python
  could handle it) stopped as asked: 130 for Ctrl-C, else 75. torchrun prints its
  SignalException or ChildFailedError trace and exits 1.
- A group in which a worker exits with one of those deliberate statuses is not restarted under
  --max-restarts, and that status is the launcher's, also when a peer failed as it left: only
  crashes are restarted.
- TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 unless set: a restarted group otherwise can read the
  previous attempt's addresses from the agent's store (pytorch#135712).
`LOGLEVEL=INFO` (torch's own switch) shows the agent's log lines again.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Optional, Sequence

from launch.worker_signals import exited, send, send_once_started, wait_for_exit

# How long the workers get to stop at once by themselves after a second Ctrl-C.
STOP_AT_ONCE_S = 3.0
# The trainer's exit statuses that are decisions, not faults: stopped by hand, stopped and saved,
# a failed save, a setting. A restart would not change them.
DELIBERATE = {2, 74, 75, 130}
INTERRUPTED = 130
STOPPED = 75  # the trainer's preemption status: start the same run again
# Passed on to the workers: Ctrl-C, SIGTERM, and the trainer's save.signal choices that torchrun
# does not handle itself (SIGHUP is torchrun's, unless a save.signal= override names it).
FORWARDED = ("SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2")
USAGE_ERROR = 2  # a mistake on the command line, as the trainer's own
# After one worker's deliberate exit, how long the others get to end by themselves before the
# agent stops them: they take the same decision at the same step boundary, or a moment later
# (trainer/cli.py's SILENT_RANK_EXIT_DELAY_S), unless they are waiting for the one that left.
DELIBERATE_GRACE_S = 5.0
AT_ONCE_LINE = ("interrupted: stopped at once, without saving; the checkpoints written so far "
                "are kept")
# torchrun's own loggers: what they say on a stop or a failure is said by the workers' lines and
# this launcher's exit status.
_TORCHRUN_LOGGERS = ("torch.distributed.elastic", "torch.distributed.run",
                     "torch.distributed.launcher")


class Group:
    """What this launcher knows of its workers: the agent running them and the stop asked for."""

    def __init__(self, forwarded: Sequence[str] = FORWARDED) -> None:
        self.agent = None
        self.forwarded = tuple(forwarded)
        self.stopping: Optional[signal.Signals] = None  # the first stop signal passed on
        self.at_once = False  # a second Ctrl-C
        self.deliberate = False  # a worker ended with one of DELIBERATE
        self.killed_rank0 = False  # rank 0 had to be SIGKILLed: it printed no line

    def pids(self) -> dict[int, int]:
        """local rank -> pid of the workers started now ({} before the first start)."""
        context = getattr(self.agent, "_pcontext", None)
        return dict(context.pids()) if context is not None else {}

    def on_signal(self, number: int, frame: object) -> None:
        pids = self.pids()
        sig = signal.Signals(number)
        if not pids:  # still in the rendezvous: nothing started, nothing to save
            if sig == signal.SIGINT:
                raise KeyboardInterrupt
            raise StoppedBeforeStart(sig)
        if sig == signal.SIGINT and self.stopping == signal.SIGINT:
            self.at_once = True
            send(pids.values(), signal.SIGINT)
            self.killed_rank0 = self._kill_after(pids, STOP_AT_ONCE_S) or self.killed_rank0
            return
        self.stopping = self.stopping or sig
        # Not into a worker's interpreter start: Python's own trace, status 1 (worker_signals).
        send_once_started(pids.values(), sig)

    def _kill_after(self, pids: dict[int, int], seconds: float) -> bool:
        """SIGKILL the workers still running `seconds` from now; whether rank 0 was one."""
        wait_for_exit(pids.values(), seconds)
        running = [local for local, pid in pids.items() if not exited(pid)]
        send([pids[local] for local in running], signal.SIGKILL)
        return 0 in running and self.group_rank() == 0

    def group_rank(self) -> int:
        group = getattr(self.agent, "_worker_group", None)
        return getattr(group, "group_rank", 0) or 0

    def install(self) -> None:
        """Ours for the forwarded signals, replacing what torchrun set when it started
        workers."""
        for name in self.forwarded:
            signal.signal(getattr(signal, name), self.on_signal)


class StoppedBeforeStart(Exception):
    """A stop signal (not Ctrl-C) before any worker started."""

    def __init__(self, sig: signal.Signals) -> None:
        super().__init__(sig.name)
        self.sig = sig


def agent_class(group: Group):
    """torch's LocalElasticAgent, told what this launcher does differently."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class Agent(LocalElasticAgent):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            group.agent = self

        def _start_workers(self, worker_group):
            started = super()._start_workers(worker_group)
            group.install()  # torchrun installed its own handlers as it started them
            return started

        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            # One worker's decision (saved and stopped, a mistake) stops the group even where
            # another failed as it went (a peer leaving mid-teardown): restarting would run a
            # stopped job on.
            if result.is_failed() and (group.stopping or any(
                    f.exitcode in DELIBERATE for f in result.failures.values())):
                group.deliberate = True
                self._remaining_restarts = 0  # a decision, not a fault: not restarted
            return result

        def _stop_workers(self, worker_group) -> None:
            if group.stopping or group.deliberate:
                # One worker has ended; the others are finishing their save or their own exit.
                # Stopping by hand they get all the time they need (Ctrl-C again ends it).
                wait_for_exit(group.pids().values(),
                              None if group.stopping else DELIBERATE_GRACE_S)
            super()._stop_workers(worker_group)

    return Agent


def status_of(failed, group: Group) -> int:
    """The launcher's exit status for torch's ChildFailedError, and the line a killed worker
    could not print."""
    if group.at_once:
        if group.killed_rank0:
            print(AT_ONCE_LINE, file=sys.stderr, flush=True)
        return INTERRUPTED
    rank, first = failed.get_first_failure()
    # A worker killed by a signal nobody here sent (kill -9, the OOM killer) is the news, also
    # where the others then stopped deliberately (75, asked to by torchrun's stop): a requeue
    # on 75 would run into the same kill again.
    asked = group.stopping.value if group.stopping else None
    killed = {r: f for r, f in failed.failures.items() if f.exitcode < 0 and -f.exitcode != asked}
    decided = {r: f for r, f in failed.failures.items() if f.exitcode in DELIBERATE}
    if killed:
        rank, first = min(killed.items())
    elif decided:  # the decision, not a peer's failure after it
        rank, first = min(decided.items())
    if first.exitcode > 0:
        if first.exitcode == STOPPED and asked not in (None, signal.SIGINT):
            # The group's verdict last: rank 0's line may be missing (ended by the signal while
            # starting, before its handler) or followed by a peer's C++ error (a gloo connect
            # cut short when rank 0 left during start-up).
            print(f"stopped by {group.stopping.name}: every worker has ended (status 75); "
                  "start the same run again to continue", file=sys.stderr, flush=True)
        return first.exitcode  # the worker's own status; it printed its own line
    if -first.exitcode == asked:  # ended by the signal passed on, before it could say so
        print(AT_ONCE_LINE if asked == signal.SIGINT else
              f"stopped by {group.stopping.name} before the workers could act on it: nothing "
              "was saved; start the same run again", file=sys.stderr, flush=True)
        return INTERRUPTED if asked == signal.SIGINT else STOPPED
    name = first.signal_name()
    print(f"error: rank {rank} (pid {first.pid}) was killed by {name}"
          + ("; out of memory? (the kernel's OOM killer sends SIGKILL)"
             if name == "SIGKILL" else ""), file=sys.stderr, flush=True)
    return 1


class _Quiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.name.startswith(_TORCHRUN_LOGGERS)


def _quiet_torchrun() -> None:
    if "LOGLEVEL" in os.environ:  # asked for torch's own logging
        return
    quiet = _Quiet()
    # torch gives some of its loggers ("torch", "torch.distributed") handlers of their own.
    names = ["torch", *(n for n in logging.root.manager.loggerDict if n.startswith("torch."))]
    for handler in [h for n in names for h in logging.getLogger(n).handlers]:
        handler.addFilter(quiet)
    for handler in logging.getLogger().handlers:
        handler.addFilter(quiet)


def _stopped_while_importing(number: int, frame: object) -> None:
    if number == signal.SIGINT:
        os.write(2, f"{AT_ONCE_LINE}\n".encode())
        os._exit(INTERRUPTED)
    os.write(2, f"stopped by {signal.Signals(number).name} before any worker started; start "
                "the same run again\n".encode())
    os._exit(STOPPED)


def _save_signal(argv: Sequence[str]) -> Optional[str]:
    """The signal a `save.signal=NAME` override among the trainer's arguments names."""
    for arg in argv:
        key, _, value = arg.lstrip("+").partition("=")
        if key == "save.signal" and value.startswith("SIG") and hasattr(signal, value):
            return value
    return None


def _bad_nproc(value: str) -> Optional[str]:
    """What is wrong with --nproc-per-node (torchrun takes 0 and starts no worker), or None."""
    if value in ("auto", "cpu", "gpu", "xpu"):
        return None
    if not value.lstrip("-").isdigit() or int(value) < 1:
        return (f"must be a number of processes per node of at least 1 (or auto, cpu, gpu), "
                f"got {value}")
    return None


def _without(signals: str, handled: Sequence[str]) -> str:
    return ",".join(s for s in signals.split(",") if s.strip() and s.strip() not in handled)


def _parser(torchrun, trainer_cli):
    """torchrun's own parser, its help led by what this launcher and blocktrain add."""
    import argparse

    parser = torchrun.get_args_parser()
    parser.prog = "python -m launch.run"
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.usage = "python -m launch.run [torchrun's options] -m trainer [overrides]"
    parser.description = (
        "blocktrain's torchrun (also blocktrain-run): torchrun's options, rendezvous and "
        "workers,\nwith a training run's stopping: Ctrl-C and SIGTERM reach the workers, which "
        "finish their\nstep, save and exit (a second Ctrl-C stops them at once); a deliberate "
        "exit is not\nrestarted by --max-restarts; the workers' own exit status is the "
        "launcher's.\n\n"
        f"{trainer_cli.EXIT_STATUSES}\n\n{trainer_cli.RUNS}\n\ntorchrun's own help follows.\n\n"
        f"{parser.description}")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = _save_signal(argv)
    group = Group(FORWARDED + ((extra,) if extra and extra not in FORWARDED else ()))
    # torch's imports take seconds, and a KeyboardInterrupt raised inside them can come out as
    # an ImportError trace, or be swallowed by an optional import's `except ImportError` (the
    # run then started anyway): a stop signal there ends the launcher at once, nothing started
    # yet. A background job keeps ignoring what it was started ignoring.
    for name in group.forwarded:
        if signal.getsignal(getattr(signal, name)) is not signal.SIG_IGN:
            signal.signal(getattr(signal, name), _stopped_while_importing)
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher import api as launcher_api

    from trainer import cli as trainer_cli  # for --help; hydra's imports take seconds too

    group.install()  # a Ctrl-C during the rendezvous stops at once
    _quiet_torchrun()
    args = _parser(torchrun, trainer_cli).parse_args(argv)
    bad = _bad_nproc(str(args.nproc_per_node))
    if bad:
        print(f"error: --nproc-per-node: {bad}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(USAGE_ERROR)
    if hasattr(args, "signals_to_handle"):  # ours are those we forward
        args.signals_to_handle = _without(args.signals_to_handle, group.forwarded)
    launcher_api.LocalElasticAgent = agent_class(group)  # launch_agent builds the agent by name
    try:
        torchrun.run(args)
        status = 0
    except ChildFailedError as failed:
        status = status_of(failed, group)
    except KeyboardInterrupt:
        print(AT_ONCE_LINE, file=sys.stderr, flush=True)
        status = INTERRUPTED
    except StoppedBeforeStart as exc:
        print(f"stopped by {exc.sig.name} before any worker started; start the same run again",
              file=sys.stderr, flush=True)
        status = STOPPED
    except SignalException as exc:  # SIGHUP, SIGQUIT, or one added with --signals-to-handle
        print(f"error: stopped by {exc.sigval.name}; the workers were stopped",
              file=sys.stderr, flush=True)
        status = 128 + int(exc.sigval)
    except Exception as exc:  # the rendezvous: a node that never came, an address in use
        if "LOGLEVEL" in os.environ:
            raise
        first = next((line for line in str(exc).splitlines() if line.strip()), "")
        hint = ("; not every node joined in time (--nnodes, --rdzv-endpoint, --rdzv-conf "
                "join_timeout=...)" if type(exc).__name__ == "RendezvousTimeoutError" else "")
        print(f"error: torchrun: {type(exc).__name__}" + (f": {first}" if first else "") + hint,
              file=sys.stderr, flush=True)
        status = 1
    # Without the interpreter's teardown (torch's modules take most of a second to collect):
    # the workers are gone, and a stopped group should hand the terminal back at once.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
