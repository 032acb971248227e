"""Whole runs on text and chat documents (issue 25): the loss is the mean over the global
batch's supervised tokens whatever the ranks and micro-batches, a stopped run resumes bit for
bit, and on another number of ranks it continues the same order of windows."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import QUICK, REPO, check_ok, read_metrics, run_trainer, step_losses
from trainer.data.demo import chat_records, make_tokenizer, text_records, write_jsonl



@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("docs")
    return {"tokenizer": str(make_tokenizer(root / "tok")),
            "chat": str(write_jsonl(root / "chat.jsonl", chat_records(400, seed=1))),
            "text": str(write_jsonl(root / "text.jsonl", text_records(400, seed=2))),
            "cache": str(root / "cache")}


def base(data: dict, kind: str, steps: int = 8) -> list[str]:
    return [*QUICK, f"data={kind}", f"data.path={data[kind]}", f"data.tokenizer={data['tokenizer']}",
            f"data.cache_dir={data['cache']}", "data.seq_len=64", "model.vocab_size=320",
            f"train.steps={steps}", "train.eval_every=4", "optim.warmup_steps=1"]


def test_the_loss_does_not_depend_on_ranks_or_micro_batches(tmp_path, data) -> None:
    """Micro-batches of chat windows hold different numbers of supervised tokens: the loss is
    their mean over the global batch (one rank x 4, two ranks x 2, one rank x 2 x accumulation
    2), not a mean of means."""
    runs = {}
    for name, nproc, extra in (("one", 1, ["train.micro_batch_size=4"]),
                               ("two", 2, ["train.micro_batch_size=2"]),
                               ("accum", 1, ["train.micro_batch_size=2", "train.grad_accum=2"])):
        run_dir = tmp_path / name
        check_ok(run_trainer([*base(data, "chat", steps=4), *extra, f"hydra.run.dir={run_dir}"],
                             REPO, nproc=nproc))
        runs[name] = step_losses(run_dir)
    for name in ("two", "accum"):
        for step, loss in runs["one"].items():
            assert runs[name][step] == pytest.approx(loss, rel=1e-6), (name, step)
    logged = [m for m in read_metrics(tmp_path / "one") if "loss" in m]
    counts = {m["supervised_tokens"] for m in logged}
    assert len(counts) > 1, counts
    assert all(0 < m["packing_efficiency"] <= 1 for m in logged), [m["packing_efficiency"] for m in logged]
    # packing_efficiency: real tokens over capacity; supervised_fraction: learned of the real.
    window_tokens = 4 * 64  # micro-batch 4 x data.seq_len of base()
    for m in logged:
        real = m["tokens_per_s"] * m["step_time_s"]
        assert m["packing_efficiency"] == pytest.approx(real / window_tokens, rel=1e-6)
        assert m["supervised_fraction"] == pytest.approx(m["supervised_tokens"] / real, rel=1e-6)


def test_chat_stop_and_resume_is_bitwise(tmp_path, data) -> None:
    run = [*base(data, "chat"), "train.micro_batch_size=2", "save.every=2"]
    reference = tmp_path / "reference"
    check_ok(run_trainer([*run, f"hydra.run.dir={reference}"], REPO, nproc=2))
    stopped = tmp_path / "stopped"
    run_trainer([*run, f"hydra.run.dir={stopped}", "train.stop_at_step=4"], REPO, nproc=2)
    assert max(step_losses(stopped)) == 4
    check_ok(run_trainer([*run, f"hydra.run.dir={stopped}"], REPO, nproc=2))
    assert step_losses(stopped) == step_losses(reference)  # exact floats, every step


def test_text_resumes_on_three_ranks_then_one(tmp_path, data) -> None:
    """2 ranks stop at step 3, 3 ranks go on to step 6, 1 rank finishes: the same global batches
    in the same order as an uninterrupted 2-rank run, so the same losses (summed in another
    order: to rounding)."""
    run = [*base(data, "text", steps=9), "train.global_batch_size=6", "save.every=3"]
    reference = tmp_path / "reference"
    check_ok(run_trainer([*run, "train.micro_batch_size=3", f"hydra.run.dir={reference}"],
                         REPO, nproc=2))
    here = [*run, f"hydra.run.dir={tmp_path / 'moved'}"]
    run_trainer([*here, "train.micro_batch_size=3", "train.stop_at_step=3"], REPO, nproc=2)
    resumed = run_trainer([*here, "train.micro_batch_size=2", "train.stop_at_step=6"], REPO,
                          nproc=3)
    assert "saved by 2 ranks, resumed on 3" in resumed.stderr + resumed.stdout
    check_ok(run_trainer([*here, "train.micro_batch_size=6"], REPO, nproc=1))
    ours, theirs = step_losses(tmp_path / "moved"), step_losses(reference)
    assert ours.keys() == theirs.keys() == set(range(1, 10))
    for step in ours:
        assert ours[step] == pytest.approx(theirs[step], rel=1e-5), step
    records = [m for m in read_metrics(reference) if "loss" in m]
    # Text supervises every real token; throughput counts real tokens, not padding.
    assert all(m["supervised_tokens"] <= 6 * 64 for m in records)
    assert all(m["tokens_per_s"] * m["step_time_s"] == pytest.approx(m["supervised_tokens"])
               for m in records)


def test_a_missing_file_is_one_line_before_anything_starts(tmp_path, data) -> None:
    run_dir = tmp_path / "run"
    result = run_trainer([*base(data, "chat"), "data.path=/nope/chats.jsonl",
                          f"hydra.run.dir={run_dir}"], REPO)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == ["error: data.path: no such file: /nope/chats.jsonl"], result.stderr[-2000:]
    assert not Path(run_dir).exists()


def test_a_stream_resumes_exactly_and_refuses_another_world_size(tmp_path, data) -> None:
    run = [*base(data, "chat"), "data.streaming=true", f"data.val_path={data['chat']}",
           "train.micro_batch_size=2", "save.every=2"]
    reference = tmp_path / "reference"
    check_ok(run_trainer([*run, f"hydra.run.dir={reference}"], REPO, nproc=2))
    stopped = tmp_path / "stopped"
    run_trainer([*run, f"hydra.run.dir={stopped}", "train.stop_at_step=4"], REPO, nproc=2)
    refused = run_trainer([*run, f"hydra.run.dir={stopped}", "train.micro_batch_size=4"], REPO)
    assert refused.returncode == 2
    assert ("error: data.streaming: this run streams its data and was saved by 2 ranks with a "
            "global batch of 4; a stream resumes only on the same (now 1 ranks, 4)") in (
        refused.stderr), refused.stderr[-2000:]
    check_ok(run_trainer([*run, f"hydra.run.dir={stopped}"], REPO, nproc=2))
    assert step_losses(stopped) == step_losses(reference)
    assert {m["supervised_tokens"] for m in read_metrics(reference) if "loss" in m} != {0}
