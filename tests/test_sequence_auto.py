"""sharding.sequence=auto through the trainer (issue 43): when `auto` picks a degree, the run's
layout is that degree's, so the ranks of a sequence group read one sample between them. The
2-rank run where auto picks 2 must read the batches, and give the losses bit for bit, of the same
run with sharding.sequence=2 written out."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import QUICK, check_ok, read_metrics, run_trainer

# The tiny model on 256-token windows: at degree 1 no plan fits 0.011 GiB per rank (the least
# is 0.012), at degree 2 one does (trainer.report --world-size 2 says so for these settings).
RUN = [*QUICK, "data=synthetic", "data.seq_len=256", "model.max_seq_len=256",
       "model.dropout=0", "train.micro_batch_size=1", "train.steps=3", "save.every=0",
       "train.eval_every=3", "train.eval_batches=2", "checkpointing=auto",
       "train.memory_gib=0.011"]


def test_auto_degree_2_trains_as_degree_2_written_out(tmp_path: Path) -> None:
    chosen, written = tmp_path / "auto", tmp_path / "two"
    check_ok(run_trainer([*RUN, "sharding.sequence=auto", f"hydra.run.dir={chosen}"],
                         tmp_path, nproc=2))
    check_ok(run_trainer([*RUN, "sharding.sequence=2", f"hydra.run.dir={written}"],
                         tmp_path, nproc=2))
    decision = json.loads((chosen / "auto.json").read_text())["decision"]
    assert decision["sequence"] == 2  # the memory above made auto share each sample
    log = (chosen / "train.log").read_text()
    assert "sequence groups 1 of 2 ranks" in log  # the layout says so, not only the model
    # One 256-token sample a step between the two ranks (tokens_seen), and the same numbers.
    steps = [_step(m) for m in read_metrics(chosen) if "loss" in m]
    assert [m["tokens_seen"] for m in steps] == [256, 512, 768]
    assert steps == [_step(m) for m in read_metrics(written) if "loss" in m]
    assert [m["val_loss"] for m in read_metrics(chosen) if "val_loss" in m] == \
        [m["val_loss"] for m in read_metrics(written) if "val_loss" in m]


def _step(metrics: dict) -> dict:
    return {k: metrics[k] for k in ("step", "loss", "grad_norm", "tokens_seen")}
