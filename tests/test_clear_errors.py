"""Mistakes found after the command line parses still end in one line naming what to change,
with no traceback, and nothing is lost or silently repeated (issue 13's first half)."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import zlib
from contextlib import redirect_stderr
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import QUICK, check_ok, read_metrics, run_trainer
from trainer import cli

TINY_RUN = QUICK + ["data=synthetic", "train.steps=2", "save.every=0"]


def _check_command(argv: list[str], cwd: Path) -> tuple[int, str]:
    """The checks before Hydra, in this process: (status, what it printed)."""
    err = io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with redirect_stderr(err):
            status = cli.check_command(argv, {})
    finally:
        os.chdir(old)
    return status, err.getvalue()


def _one_line(text: str, starts: str) -> None:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert "Traceback" not in text and lines[-1].startswith(starts), text[-3000:]


def _token_dir(tmp_path: Path, ids: list[int], meta: dict | None = None) -> Path:
    folder = tmp_path / "tokens"
    folder.mkdir()
    for split in ("train", "val"):
        np.asarray(ids * 200, dtype="<u2").tofile(folder / f"{split}.bin")
    if meta is not None:
        (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def test_mistakes_found_before_the_run_directory_is_made(tmp_path) -> None:
    config_dir = tmp_path / "hf"
    config_dir.mkdir()
    (config_dir / "config.json").write_text('{"model_type": "llama", "hidden_size": 64,')
    tokens = _token_dir(tmp_path, [1, 2, 3, 300])
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    cases = [
        (["train.out_dir=/proc/x"], "error: train.out_dir: /proc/x is not writable"),
        (["hydra.run.dir=/etc/hostname"], "error: hydra.run.dir: /etc/hostname exists and is not"),
        (["checkpointing=selective", "checkpointing.save_ops=[notanop]"],
         "error: checkpointing.save_ops: 'notanop' is not an aten op"),
        (["model.block_pattern=nothing.*"], "error: model.block_pattern: 'nothing.*' matches no"),
        (["faults.inject_nan_at=[-1]"], "error: faults.inject_nan_at: data batch indices"),
        (["model=hf", "model.hf_config={model_type: lamma}"],
         "error: model.hf_config.model_type: model_type 'lamma' is not one transformers knows; "
         "did you mean llama"),
        (["model=hf", f"model.path={config_dir}"],
         f"error: model.path: {config_dir}/config.json is not valid JSON"),
        (["data=tokens", f"data.train_path={odd}", f"data.val_path={odd}"],
         f"error: data.train_path: {odd} is 3 bytes, not a multiple of 2"),
        (["data=tokens", f"data.train_path={tokens}/train.bin", f"data.val_path={tokens}/val.bin",
          "model.vocab_size=256"],
         f"error: data.train_path: {tokens}/train.bin holds token id 300, but model.vocab_size "
         "is 256"),
    ]
    for argv, expected in cases:
        status, printed = _check_command(argv, tmp_path)
        assert status == 2, (argv, printed)
        _one_line(printed, expected)
    assert not (tmp_path / "outputs").exists()  # nothing written for any of them
    # Through the real command line: the same line, exit 2, no traceback, no run directory.
    result = run_trainer(["model.block_pattern=nothing.*"], cwd=tmp_path)
    assert result.returncode == 2 and not (tmp_path / "outputs").exists()
    _one_line(result.stderr, "error: model.block_pattern:")


def test_token_range_comes_from_meta_json_when_the_tokenizer_recorded_it(tmp_path) -> None:
    from trainer.data.tokens import token_file
    from trainer.data.token_source import largest_token_id

    folder = _token_dir(tmp_path, [5, 7, 9])
    tokens = token_file(str(folder / "train.bin"), "uint16")
    assert largest_token_id(str(folder / "train.bin"), tokens, None) == 9  # scanned
    recorded = {"max_id": {"train": 8}, "num_tokens": {"train": len(tokens)}}
    # Recorded for this file (same length): believed without reading the file.
    assert largest_token_id(str(folder / "train.bin"), tokens, recorded) == 8
    stale = {"max_id": {"train": 8}, "num_tokens": {"train": len(tokens) + 1}}
    assert largest_token_id(str(folder / "train.bin"), tokens, stale) == 9


def test_tokenizer_records_the_largest_id(tmp_path) -> None:
    from trainer.data.tokenize import main as tokenize_main

    (tmp_path / "doc.txt").write_text("hello world " * 50)
    assert tokenize_main([str(tmp_path / "doc.txt"), "--out", str(tmp_path / "out"),
                          "--val-fraction", "0"]) == 0
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    ids = np.fromfile(tmp_path / "out" / "train.bin", dtype="<u2")
    assert meta["max_id"]["train"] == int(ids.max()) == ord("w")


def test_persistent_nan_without_a_checkpoint_is_one_line(tmp_path) -> None:
    result = run_trainer(TINY_RUN + ["train.steps=5", "faults.inject_nan_at=[0,1,2,3]",
                                     "faults.max_bad_steps=2", "save.at_end=false",
                                     f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert result.returncode == 1
    _one_line(result.stderr, "error: faults.max_bad_steps: 2 bad steps in a row")


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A 2-step run with its checkpoint at step 2; each test works on its own copy."""
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    check_ok(run_trainer(TINY_RUN + [f"hydra.run.dir={run_dir}"], cwd=run_dir.parent))
    return run_dir


def _copy(saved: Path, tmp_path: Path) -> Path:
    shutil.copytree(saved, tmp_path / "run")
    return tmp_path / "run"


def test_resuming_another_model_shape_names_parameter_and_setting(tmp_path, saved_run) -> None:
    run_dir = _copy(saved_run, tmp_path)
    result = run_trainer(TINY_RUN + ["train.steps=4", "model.dim=64",
                                     f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 2
    _one_line(result.stderr, f"error: save.resume: checkpoint {run_dir}/checkpoints/step_0000000"
                             "2 holds another model: ")
    assert "saved [" in result.stderr and "model.dim 128 -> 64" in result.stderr
    assert "save.resume=false" in result.stderr


def _craft_metadata(folder: Path, marker: Path) -> None:
    """A .metadata that runs a command when unpickled, with COMMITTED.json updated to match."""
    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    data = pickle.dumps(Evil())
    (folder / ".metadata").write_bytes(data)
    commit = json.loads((folder / "COMMITTED.json").read_text())
    commit["files"][".metadata"] = [len(data), zlib.crc32(data)]
    (folder / "COMMITTED.json").write_text(json.dumps(commit))


def test_a_crafted_metadata_file_runs_nothing_on_resume_or_export(tmp_path, saved_run) -> None:
    run_dir = _copy(saved_run, tmp_path)
    folder = run_dir / "checkpoints" / "step_00000002"
    marker = tmp_path / "pwned"
    _craft_metadata(folder, marker)
    result = run_trainer(TINY_RUN + ["train.steps=4", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 2 and not marker.exists()
    _one_line(result.stderr, f"error: save.resume: {folder}/.metadata names posix.system")
    from trainer.state.export import main as export_main

    with pytest.raises(SystemExit, match=r"\.metadata names posix.system.*refusing"):
        export_main([str(folder), "--out", str(tmp_path / "exported")])
    assert not marker.exists()


@pytest.mark.parametrize("damaged", ["state.json", "rng/rank0.pt"])
def test_damaged_state_files_are_named_in_one_line(tmp_path, saved_run, damaged) -> None:
    """Issue 27 item 8: files that match their checksums but are not what they should be
    (broken JSON; a pickled object instead of generator states) are damage like any other:
    named, and with no other checkpoint the run refuses. The object is never built."""
    run_dir = _copy(saved_run, tmp_path)
    folder = run_dir / "checkpoints" / "step_00000002"
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    data = (b'{"progress": {step: 2}}' if damaged == "state.json" else pickle.dumps(Evil()))
    (folder / damaged).write_bytes(data)
    commit = json.loads((folder / "COMMITTED.json").read_text())
    commit["files"][damaged] = [len(data), zlib.crc32(data)]
    (folder / "COMMITTED.json").write_text(json.dumps(commit))
    result = run_trainer(TINY_RUN + ["train.steps=4", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 2 and not marker.exists()
    why = ("state.json cannot be read as JSON (Expecting property name" if damaged == "state.json"
           else "rng/rank0.pt names posix.system, which generator states never hold")
    _one_line(result.stderr, f"error: save.resume: every checkpoint in {run_dir}/checkpoints is "
                             f"damaged (step_00000002: {why}")
    assert "weights_only" not in result.stdout + result.stderr


@pytest.mark.parametrize("named_by", ["hydra.run.dir", "train.run_name"])
def test_a_run_directory_has_one_live_owner(tmp_path, saved_run, named_by) -> None:
    """A second run on a live run's directory is refused in one line naming the setting that
    named the directory, and writes nothing there: not Hydra's .hydra/ files, not train.log
    (issue 27, items 5 and 11)."""
    from trainer.state.ownership import RunLock

    run_dir = _copy(saved_run, tmp_path)
    where = ([f"hydra.run.dir={run_dir}"] if named_by == "hydra.run.dir"
             else [f"train.out_dir={tmp_path}", "train.run_name=run"])
    records = {p: p.read_bytes() for p in [*run_dir.glob(".hydra/*"), run_dir / "train.log",
                                           run_dir / "metrics.jsonl"]}
    assert len(records) == 5
    lock = RunLock(str(run_dir))
    lock.acquire()  # a live run holds it
    try:
        result = run_trainer(TINY_RUN + ["train.steps=4", "optim.lr=0.5", *where], cwd=tmp_path)
    finally:
        lock.release()
    assert result.returncode == 2
    _one_line(result.stderr, f"error: {named_by}: run directory {run_dir} is in use by pid "
                             f"{os.getpid()} on ")
    assert result.stderr.strip().endswith(f"start this one under another {named_by}")
    assert {p: p.read_bytes() for p in records} == records  # the live run's records, untouched
    # The holder is gone; its lock file stays behind and is simply taken over.
    assert (run_dir / ".lock").exists()
    check_ok(run_trainer(TINY_RUN + ["train.steps=3", *where], cwd=tmp_path))


def test_starting_over_sets_the_old_history_aside(tmp_path, saved_run) -> None:
    run_dir = _copy(saved_run, tmp_path)
    old_losses = [m["loss"] for m in read_metrics(run_dir) if "loss" in m]
    check_ok(run_trainer(TINY_RUN + ["train.steps=1", "save.resume=false",
                                     f"hydra.run.dir={run_dir}"], cwd=tmp_path))
    previous = sorted(run_dir.glob("previous-*"))
    assert len(previous) == 1 and (previous[0] / "checkpoints" / "step_00000002").is_dir()
    assert [m["loss"] for m in read_metrics(previous[0]) if "loss" in m] == old_losses
    assert [m["step"] for m in read_metrics(run_dir) if "loss" in m] == [1]
    # The next plain start resumes the new history (step 1), not the old one (step 2).
    result = run_trainer(TINY_RUN + ["train.steps=3", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    check_ok(result)
    assert "resumed from " + str(run_dir / "checkpoints" / "step_00000001") in result.stdout
    assert [m["step"] for m in read_metrics(run_dir) if "loss" in m] == [1, 2, 3]


def test_every_checkpoint_damaged_is_refused_not_restarted(tmp_path, saved_run) -> None:
    run_dir = _copy(saved_run, tmp_path)
    shard = next((run_dir / "checkpoints" / "step_00000002").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-1] + b"\xff")
    result = run_trainer(TINY_RUN + ["train.steps=4", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert result.returncode == 2
    _one_line(result.stderr, f"error: save.resume: every checkpoint in {run_dir}/checkpoints is "
                             "damaged (step_00000002: ")
    assert [m["step"] for m in read_metrics(run_dir) if "loss" in m] == [1, 2]  # nothing appended


def test_a_corrupt_image_is_named_or_skipped_and_logged(tmp_path) -> None:
    from tests.test_vit import CLI, _image_folder
    from trainer.data.images import ImageFolder

    _image_folder(tmp_path / "data")
    bad = tmp_path / "data" / "train" / "blue" / "1.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really a picture")
    folder = ImageFolder(str(tmp_path / "data" / "train"), 32, 3, "data.train_path")
    with pytest.raises(ValueError, match=f"^data.train_path: {bad} cannot be read as an image"):
        folder[1]
    skipping = ImageFolder(str(tmp_path / "data" / "train"), 32, 3, "data.train_path",
                           skip_bad=True)
    image, label = skipping[1]  # the next readable image takes its place, the same every time
    assert label == 0 and image.equal(folder[2][0]) and skipping.skipped == {str(bad)}
    # Through the trainer: one line naming the file, status 2; with the switch, it trains.
    data = [*CLI, "data=images", f"data.train_path={tmp_path / 'data/train'}",
            f"data.val_path={tmp_path / 'data/val'}", "model.num_classes=2", "train.steps=2",
            "train.micro_batch_size=12", "train.eval_batches=1"]
    result = run_trainer(data + [f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert result.returncode == 2
    _one_line(result.stderr, f"error: data.train_path: {bad} cannot be read as an image")
    result = run_trainer(data + ["data.skip_bad_images=true", f"hydra.run.dir={tmp_path / 'ok'}"],
                         cwd=tmp_path)
    check_ok(result)
    assert f"data.skip_bad_images: skipping {bad}" in (tmp_path / "ok" / "train.log").read_text()


def test_a_file_system_without_locks_warns_instead_of_failing(tmp_path, monkeypatch, caplog):
    import errno
    import fcntl

    from trainer.state.ownership import RunLock

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    lock = RunLock(str(tmp_path))
    lock.acquire()  # Lustre without -o flock: the run goes on, and says what it cannot do
    lock.release()
    assert "cannot lock the run directory" in caplog.text


def test_launch_run_with_no_processes_per_node_is_one_line_exit_2(tmp_path) -> None:
    """torchrun takes --nproc-per-node 0 and fails later with its own trace (exit 1)."""
    import subprocess
    import sys

    from tests.helpers import subprocess_env

    done = subprocess.run([sys.executable, "-m", "launch.run", "--nproc-per-node", "0", "-m",
                           "trainer"], cwd=tmp_path, env=subprocess_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip() == (
        "error: --nproc-per-node: must be a number of processes per node of at least 1 (or "
        "auto, cpu, gpu), got 0"), done.stderr[-2000:]


def test_an_attention_the_hf_model_lacks_names_model_attn_implementation(tmp_path) -> None:
    """transformers refuses sdpa for Gemma 2 with a paragraph and a trace: one line instead."""
    gemma2 = ("model.hf_config={model_type: gemma2, vocab_size: 256, hidden_size: 64, "
              "intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, "
              "num_key_value_heads: 2, head_dim: 16}")
    result = run_trainer([*QUICK, "model=hf", gemma2, "data=synthetic", "train.steps=1",
                          "data.seq_len=32", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: model.attn_implementation: sdpa: transformers says: "
                           "Gemma2ForCausalLM does not support") and line.endswith(
        "set model.attn_implementation=eager (or another the model supports)")


@pytest.mark.parametrize("after_s", [0.3, 1.5, 4.0])
def test_ctrl_c_during_start_up_is_one_line_and_130(tmp_path, after_s) -> None:
    """Imports (0.3 s), the pre-flight check and config (1.5 s), building the model (4 s here;
    on a quick machine the run trains by then, and its own Ctrl-C line says it saves): exit 130
    with one line, never a KeyboardInterrupt trace nor SIGINT's default action (status -2: the
    4 s Ctrl-C once landed in the interpreter's teardown of a run that had just ended, where
    every handler is the default again; the entry point now exits without it: see
    tests/test_start_signals.py)."""
    import signal
    import subprocess
    import time

    from tests.helpers import REPO, subprocess_env, trainer_command, wait_until_handling

    child = subprocess.Popen(trainer_command([*QUICK, "data=synthetic", "train.steps=100000",
                                              "save.every=0",
                                              f"hydra.run.dir={tmp_path / 'run'}"]),
                             cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    wait_until_handling(child.pid)  # after_s from our first line, not the interpreter's start
    time.sleep(after_s)
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(("interrupted", "Ctrl-C: finishing")), err


@pytest.mark.parametrize("after_s", [0.5, 1.2, 3.0])
def test_ctrl_c_while_launch_run_starts_is_one_line_and_130(tmp_path, after_s) -> None:
    """The launcher's torch imports (a KeyboardInterrupt there came out as a trace, an
    ImportError, or was swallowed and the run went on), the rendezvous, the workers' imports:
    the terminal's Ctrl-C (the whole process group) ends all of it, 130 and one line."""
    import signal
    import subprocess
    import time

    from tests.helpers import REPO, subprocess_env, trainer_command, wait_until_handling

    agent = subprocess.Popen(trainer_command([*QUICK, "data=synthetic", "train.steps=50",
                                              f"hydra.run.dir={tmp_path / 'run'}"], nproc=2,
                                             launcher="launch.run"),
                             cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_until_handling(agent.pid)  # after_s from our first line, not the interpreter's start
    time.sleep(after_s)
    os.killpg(agent.pid, signal.SIGINT)
    _, err = agent.communicate(timeout=120)
    assert agent.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("interrupted")
