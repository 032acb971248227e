"""Stop signals from the first line of start-up (issue 47, faults 2-7): SIGTERM, SIGUSR1 (the
default save.signal) and Ctrl-C while a rank waits on the data cache's lock, while rank 0
tokenizes, while workers import; a worker killed by SIGKILL named; launch.run passing SIGUSR1 on.

Each signal is sent at a state the test sees, not after a fixed time: a handler installed
(/proc/<pid>/status), a process blocked on the cache's lock (/proc/locks, while the test holds
it), the line that says tokenizing began, the workers started. Data: 40 tiny conversations."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import QUICK, config, start_trainer
from trainer.data.demo import chat_records, make_tokenizer, write_jsonl

SLOW = 180.0  # the longest a state may take to come on this loaded machine
# A template that never finishes rendering a reply of "wait here" (jinja's range stops at 1e5).
STUCK = ("{% for m in messages %}{% if m['content'] == 'wait here' %}{% for i in range(100000) %}"
         "{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}<|im_start|>"
         "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")


def _until(check, process: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + SLOW
    while time.monotonic() < deadline:
        if check():
            return
        assert process.poll() is None, f"ended ({process.returncode}) before {what}"
        time.sleep(0.05)
    raise AssertionError(f"not reached: {what}")


def _catches(pid: int, sig: signal.Signals) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) >> (sig - 1) & 1)


def _blocked_on(lock: Path) -> set[int]:
    """The pids waiting for an flock of `lock`."""
    if not lock.exists():
        return set()
    inode = os.stat(lock).st_ino
    waiting = set()
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "->" in fields and fields[fields.index("->") + 1] == "FLOCK":
            at = fields.index("->")
            if int(fields[at + 5].split(":")[-1]) == inode:
                waiting.add(int(fields[at + 4]))
    return waiting


def _data(tmp_path: Path, template: str | None = None,
          num_proc: int = 1) -> tuple[list[str], Path]:
    """The run's data overrides, and the cache lock its preparer takes."""
    from trainer.data.documents import cache_key
    from trainer.data.sources import document_settings, load_tokenizer

    tokenizer = make_tokenizer(tmp_path / "tok", **({"template": template} if template else {}))
    records = chat_records(40 if num_proc == 1 else 600, seed=3)  # > 256: a batch a worker
    records[7]["messages"][-1]["content"] = "wait here"
    path = write_jsonl(tmp_path / "chat.jsonl", records)
    overrides = ["data=chat", f"data.path={path}", f"data.tokenizer={tokenizer}",
                 f"data.cache_dir={tmp_path / 'cache'}", "model.vocab_size=320",
                 f"data.num_proc={num_proc}"]
    cfg = config(*QUICK, *overrides)
    key = cache_key(str(path), None, load_tokenizer(str(tokenizer), "chat"),
                    document_settings(cfg.data))
    (tmp_path / "cache").mkdir()
    return overrides, tmp_path / "cache" / f"{key}.lock"


def _start(tmp_path: Path, overrides: list[str], nproc: int = 1,
           start_new_session: bool = False) -> subprocess.Popen:
    extra = {"torchrun_args": ["--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0"],
             "launcher": "launch.run"} if nproc > 1 else {}
    extra["start_new_session"] = start_new_session or nproc > 1
    return start_trainer([*QUICK, *overrides, "train.steps=3",
                          f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, nproc=nproc,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, **extra)


def _ended(process: subprocess.Popen) -> tuple[int, list[str]]:
    _, err = process.communicate(timeout=SLOW)
    assert "Traceback" not in err, err[-3000:]
    return process.returncode, [line for line in err.splitlines() if line.strip()]


def _no_temp_folder(tmp_path: Path) -> None:
    assert not list((tmp_path / "cache").glob("*.tmp-*")), list((tmp_path / "cache").iterdir())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_stop_signal_during_imports_is_one_line_and_75(tmp_path, sig) -> None:
    """Fault 6: the signal's default action (143, 138, no word) before."""
    run = _start(tmp_path, ["data=synthetic"])
    _until(lambda: _catches(run.pid, sig), run, "the entry point's handler")
    run.send_signal(sig)
    status, lines = _ended(run)
    assert status == 75 and lines[-1] == (f"stopped by {sig.name} before training started: "
                                          "nothing to save; start the same run again"), lines


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 75), (signal.SIGUSR1, 75),
                                         (signal.SIGINT, 130)])
def test_a_stop_signal_while_waiting_on_the_cache_lock(tmp_path, sig, status) -> None:
    overrides, lock = _data(tmp_path)
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another node preparing the same data
        run = _start(tmp_path, overrides)
        _until(lambda: run.pid in _blocked_on(lock), run, "waiting on the cache lock")
        run.send_signal(sig)
        got, lines = _ended(run)
    assert got == status and lines[-1].startswith("interrupted" if status == 130 else
                                                  f"stopped by {sig.name}"), lines
    _no_temp_folder(tmp_path)


def _tokenizing(tmp_path: Path) -> bool:
    log = tmp_path / "run" / "train.log"
    return log.exists() and "data: tokenizing" in log.read_text()


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_a_stop_signal_while_tokenizing_leaves_no_temp_folder(tmp_path, sig) -> None:
    """Fault 4: SIGUSR1 while tokenizing ended the process with 138 and no line, leaving
    <key>.tmp-<pid>."""
    overrides, _ = _data(tmp_path, STUCK)
    run = _start(tmp_path, overrides)
    _until(lambda: _tokenizing(tmp_path), run, "tokenizing")
    run.send_signal(sig)
    status, lines = _ended(run)
    assert status == 75 and lines[-1].startswith(f"stopped by {sig.name} while tokenizing"), lines
    _no_temp_folder(tmp_path)


def test_sigusr1_while_the_map_workers_run_is_one_line_and_75(tmp_path) -> None:
    """data.num_proc=2: SIGUSR1 to the trainer while `datasets`' workers tokenize. Before:
    status 1 and a traceback (the pool's clean-up raised a TimeoutError over our stop)."""
    overrides, _ = _data(tmp_path, STUCK, num_proc=2)
    run = _start(tmp_path, overrides)
    _until(lambda: _tokenizing(tmp_path) and len(_workers(run)) >= 2, run, "the map workers")
    workers = _workers(run)
    run.send_signal(signal.SIGUSR1)
    status, lines = _ended(run)
    assert status == 75 and lines[-1].startswith("stopped by SIGUSR1 while tokenizing"), lines
    _gone(workers)
    _no_temp_folder(tmp_path)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux: prctl")
def test_a_trainer_killed_outright_while_its_map_workers_run_leaves_none(tmp_path) -> None:
    """data.num_proc=2, SIGKILL to the trainer while `datasets`' workers tokenize (one stuck
    on a record): the workers and the manager, in process groups of their own, went on
    (the stuck one spinning a core) until killed by hand."""
    overrides, _ = _data(tmp_path, STUCK, num_proc=2)
    run, workers = _start(tmp_path, overrides), []
    try:
        _until(lambda: _tokenizing(tmp_path) and len(_workers(run)) >= 3, run,
               "the map workers and the manager")
        workers = _workers(run)
        run.kill()
        run.wait(timeout=SLOW)  # not its pipes: a survivor would hold them open
        _gone(workers)
    finally:
        run.kill()
        for pid in workers:  # what survived a failing run: not left spinning
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        run.stdout.close()
        run.stderr.close()


def _gone(workers: list[int]) -> None:
    deadline = time.monotonic() + 10  # an orphaned worker is reaped by init, a moment later
    while [pid for pid in workers if Path(f"/proc/{pid}").exists()] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()], workers


def _workers(agent: subprocess.Popen) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def test_sigusr1_to_launch_run_reaches_the_workers_waiting_on_the_lock(tmp_path) -> None:
    """Faults 2 and 5: the launcher died of SIGUSR1 (138) and its workers went on unsupervised;
    a rank waiting on the lock died of SIGTERM. Now each stops with 75, and so does the group."""
    overrides, lock = _data(tmp_path)
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        agent = _start(tmp_path, overrides, nproc=2)
        _until(lambda: len(_workers(agent)) == 2 and set(_workers(agent)) & _blocked_on(lock),
               agent, "rank 0 waiting on the cache lock")
        workers = _workers(agent)
        os.kill(agent.pid, signal.SIGUSR1)  # the launcher alone, as Slurm's --signal does
        status, lines = _ended(agent)
    assert status == 75 and lines[-1].startswith("stopped by SIGUSR1"), lines
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()]  # none orphaned
    _no_temp_folder(tmp_path)


def test_a_rank_killed_while_waiting_is_named_and_not_75(tmp_path) -> None:
    """Fault 3: kill -9 of the rank waiting for rank 0's cache: exit 75 and only rank 0's line
    before; a requeue on 75 would loop."""
    overrides, _ = _data(tmp_path, STUCK)
    agent = _start(tmp_path, overrides, nproc=2)
    _until(lambda: _tokenizing(tmp_path) and len(_workers(agent)) == 2, agent, "tokenizing")
    os.kill(max(_workers(agent)), signal.SIGKILL)  # rank 1: started second
    status, lines = _ended(agent)
    assert status == 1 and any("was killed by SIGKILL" in line for line in lines), lines
    _no_temp_folder(tmp_path)


def test_sigterm_to_launch_run_while_workers_import_is_75(tmp_path) -> None:
    """Fault 7: exit 1 ("killed by SIGTERM") before."""
    agent = _start(tmp_path, ["data=synthetic"], nproc=2)
    _until(lambda: len(_workers(agent)) == 2, agent, "the workers started")
    os.kill(agent.pid, signal.SIGTERM)
    status, lines = _ended(agent)
    assert status == 75 and lines[-1].startswith("stopped by SIGTERM"), lines


def test_a_kill_is_the_status_even_where_a_peer_then_stopped_with_75() -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from launch.run import Group, status_of

    failures = {0: ProcessFailure(local_rank=0, pid=100, exitcode=75, error_file=""),
                1: ProcessFailure(local_rank=1, pid=101, exitcode=-signal.SIGKILL,
                                  error_file="")}
    assert status_of(ChildFailedError("trainer", failures), Group()) == 1
    stopped = Group()
    stopped.stopping = signal.SIGTERM  # passed on by us, landed before the worker's handler
    failures = {0: ProcessFailure(local_rank=0, pid=100, exitcode=-signal.SIGTERM,
                                  error_file="")}
    assert status_of(ChildFailedError("trainer", failures), stopped) == 75


def test_a_group_stopped_by_a_passed_on_signal_ends_with_the_launchers_line(capsys) -> None:
    """Seen in a whole-suite run (seed 3708177472): SIGTERM while the workers imported, rank 0
    ended by it before its handler (no line) and rank 1 exited 75 silently: status 75 and not a
    word. And a SIGUSR1 at start-up left a peer's gloo connect error as the last line."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from launch.run import Group, status_of

    stopped = Group()
    stopped.stopping = signal.SIGTERM
    failures = {0: ProcessFailure(local_rank=0, pid=100, exitcode=-signal.SIGTERM,
                                  error_file=""),
                1: ProcessFailure(local_rank=1, pid=101, exitcode=75, error_file="")}
    assert status_of(ChildFailedError("trainer", failures), stopped) == 75
    assert capsys.readouterr().err.strip().splitlines() == [
        "stopped by SIGTERM: every worker has ended (status 75); start the same run again to "
        "continue"]
    failures = {0: ProcessFailure(local_rank=0, pid=100, exitcode=75, error_file="")}
    assert status_of(ChildFailedError("trainer", failures), Group()) == 75  # not asked by us
    assert capsys.readouterr().err == ""


def test_ctrl_c_is_handled_until_the_process_is_gone(tmp_path) -> None:
    """The cause of tests/test_clear_errors.py's 4 s Ctrl-C case: the interpreter's teardown
    put SIGINT back to its default action for its last moments (a Ctrl-C there: status -2, no
    line). Sampled from outside while a short run ends: SIGINT is caught whenever the process
    is there, from the entry point's first line on."""
    from tests.helpers import REPO, subprocess_env, trainer_command

    child = subprocess.Popen(trainer_command([*QUICK, "data=synthetic", "train.steps=2",
                                              "save.every=0",
                                              f"hydra.run.dir={tmp_path / 'run'}"]),
                             cwd=REPO, env=subprocess_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    status, seen, uncaught = Path(f"/proc/{child.pid}/status"), 0, []
    _until(lambda: _catches(child.pid, signal.SIGINT), child, "the entry point's handler")
    while child.poll() is None:
        try:
            lines = status.read_text().splitlines()
        except OSError:
            break
        state = next((line.split()[1] for line in lines if line.startswith("State:")), "Z")
        caught = next(line for line in lines if line.startswith("SigCgt:"))
        if state != "Z":  # a zombie has ended; only its status is left
            seen += 1
            if not int(caught.split()[1], 16) & 1 << (2 - 1):
                uncaught.append(seen)
        time.sleep(0.005)
    assert child.wait() == 0 and seen > 10 and not uncaught, (seen, uncaught)


def test_sigterm_to_the_trainer_and_its_map_workers_together_is_one_line_and_75(tmp_path) -> None:
    """data.num_proc=2: SIGTERM to the whole process group (the trainer, `datasets`' workers
    and its manager), as a scheduler or a terminal ends a job, while one worker is stuck on a
    record and the other, its share done, waits for a task. Before: the group hung (the waiting
    worker died holding the pool's task-queue lock, which the pool's clean-up then waits for)."""
    overrides, _ = _data(tmp_path, STUCK, num_proc=2)
    run = _start(tmp_path, overrides, start_new_session=True)
    try:
        _until(lambda: _tokenizing(tmp_path) and _one_waits(_workers(run)), run,
               "a map worker waiting for a task")
        workers = _workers(run)
        os.killpg(run.pid, signal.SIGTERM)
        status, lines = _ended(run)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)  # what a hang left
    assert status == 75 and lines[-1].startswith("stopped by SIGTERM while tokenizing"), lines
    _gone(workers)
    _no_temp_folder(tmp_path)


def _one_waits(children: list[int]) -> bool:
    """Whether the pool's two workers and the manager run, one worker asleep (waiting for a
    task: one thread, the manager has several) and one running (stuck on its record)."""
    states = []
    for pid in children:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return False
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        states.append((fields["State"].split()[0], int(fields["Threads"])))
    return len(children) >= 3 and ("S", 1) in states and any(s == "R" for s, _ in states)


def test_a_stop_ends_the_processes_the_preparation_started() -> None:
    """`datasets`' manager process, started in a generator the stop leaves open (the signal
    came while the caller handled a result): it outlived the preparation, a child the exit
    waits for. In this process: the stop is a real SIGUSR1 to it."""
    import multiprocess

    from trainer.data.interrupt import PrepareStopped, stop_signals

    def results():
        with multiprocess.Manager() as manager:
            yield manager.Queue()

    before = set(multiprocess.active_children())
    with pytest.raises(PrepareStopped, match="stopped by SIGUSR1 while tokenizing here"):
        with stop_signals("here"):
            opened = results()
            next(opened)
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(SLOW)
    try:
        assert set(multiprocess.active_children()) == before
    finally:
        opened.close()
