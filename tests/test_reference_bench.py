"""`python -m launch.bench --reference` (launch/bench/reference.py): it runs on a tiny
model, and blocktrain's step does no more than the plain PyTorch loop of launch/bench/plain.py
(dispatched operators, hooks, host reads) beyond what NAMED_EXTRAS names and counts."""

from __future__ import annotations

import argparse
import json

import pytest

from launch.bench import reference

TINY = ["--micro-batch", "2", "--seq", "32", "--steps", "6", "--nproc", "2"]


def _rows(out: str, model: str) -> list[list[str]]:
    return [[c.strip() for c in line.split("|")[1:-1]] for line in out.splitlines()
            if line.startswith(f"| {model} |")]


def test_an_extra_nobody_named_is_flagged() -> None:
    """The check the bench (and the tests below) rely on: equal counts pass, named extras within
    their count pass, anything more is reported."""
    def interval(ops: dict, syncs: dict, hooks: dict) -> dict:
        return {"ops": ops, "syncs": syncs, "hooks": hooks, "calls": {}}

    plain = interval({"aten.mm.default @ x": 4, "aten._local_scalar_dense.default @ x": 1},
                     {"item @ x": 1}, {"module forward_hook: m.f": 2})
    same = interval({"aten.mm.default @ y": 4, "aten._local_scalar_dense.default @ y": 1},
                    {"item @ y": 1}, {"module forward_hook: m.f": 2})
    assert reference.extras(same, plain) == {}
    named = interval({**same["ops"], "c10d.allreduce_.default @ z": 1}, {"tolist @ z": 1},
                     same["hooks"])
    assert reference.unnamed(reference.extras(named, plain)) == {}
    more = interval({**same["ops"], "c10d.allreduce_.default @ z": 3, "aten.add.Tensor @ z": 1},
                    same["syncs"], {**same["hooks"], "saved-tensor pack: meter._pack": 5})
    assert reference.unnamed(reference.extras(more, plain)) == {
        "c10d.allreduce_.default": 3, "aten.add.Tensor": 1,
        "hook saved-tensor pack: meter._pack": 5}


@pytest.mark.slow
def test_every_extra_of_the_llama_and_an_hf_model_is_named(capsys) -> None:
    """2 ranks: the built-in Llama under each policy, the HF Qwen2 under full."""
    assert reference.main(["--repeat", "0", "--models", "llama", *TINY]) == 0, \
        capsys.readouterr().out
    assert reference.main(["--repeat", "0", "--models", "hf", "--policies", "full", *TINY]) == 0
    out = capsys.readouterr().out
    rows = _rows(out, "llama") + _rows(out, "hf")
    assert [r[1] for r in rows] == ["none", "full", "selective", "full"]
    for row in rows:
        ops, hooks = (tuple(map(int, cell.split(" / "))) for cell in row[2:4])
        assert ops[1] > 100 and ops[0] - ops[1] <= sum(n for n, _ in
                                                       reference.NAMED_EXTRAS.values())
        assert hooks[0] == hooks[1]  # the saved-bytes meter counts on logged steps only


@pytest.mark.slow
def test_timed_rounds_compare_the_same_losses(capsys) -> None:
    assert reference.main(["--repeat", "1", "--models", "llama", "--policies", "full",
                           "--dropout", "0.1", *TINY]) == 0
    timed = _rows(capsys.readouterr().out, "llama")[0]
    ratio = float(timed[2].split()[0])
    assert 0.2 < ratio < 5 and timed[-1] == "yes"  # dropout on, recomputed: bitwise the same


def test_the_control_runs_the_plain_loop_on_both_sides(capsys, monkeypatch) -> None:
    """--control: two equal programs, so its ratios are the machine's spread, nothing else."""
    real, commands = reference.subprocess.Popen, []

    def spy(command, **kwargs):
        commands.append(command)
        return real(command, **kwargs)

    monkeypatch.setattr(reference.subprocess, "Popen", spy)
    assert reference.main(["--control", "--repeat", "1", "--models", "llama", "--policies",
                           "none", *TINY]) == 0
    out = capsys.readouterr().out
    rows = _rows(out, "llama")
    assert len(rows) == 1 and rows[0][-1] == "yes", out  # timed only: no counting runs
    assert len(commands) == 2 and all("launch.bench.plain" in c and "trainer" not in c
                                      for c in commands), commands
    assert "--control" in out.splitlines()[0] and "ops/step" not in out


def test_two_runs_take_turns_a_step_each(tmp_path) -> None:
    """--interleave steps (the default): the second program starts once the first has ended its
    first step, then they alternate, step k of the first before step k of the second before
    step k+1 of the first; the waits are off each one's step clock."""
    a = argparse.Namespace(control=True, nproc=1, seq=32, micro_batch=2, steps=6, device="cpu",
                           dropout=0.0, malloc="default", layers=4)
    got = reference.run_turns(("bt", "plain"), "llama", "none", a, str(tmp_path))
    first, second = (got[s]["ranks"][0] for s in ("bt", "plain"))
    ends = sorted([(t, "first") for t in first["step_ends_unix"]]
                  + [(t, "second") for t in second["step_ends_unix"]])
    assert [who for _, who in ends] == ["first", "second"] * a.steps, ends
    assert first["waited_s"] > 0 and second["waited_s"] > 0
    # Off the clock: the first's step clock runs slower than the wall clock by what it waited.
    assert first["step_ends"][-1] - first["step_ends"][0] < (
        first["step_ends_unix"][-1] - first["step_ends_unix"][0]) - 0.5 * first["waited_s"]
    assert got["bt"]["losses"] == got["plain"]["losses"]


def test_both_programs_get_the_same_number_of_blocks() -> None:
    """--layers reaches blocktrain's settings and the plain loop's flags, for both models."""
    a = argparse.Namespace(control=False, nproc=2, seq=32, micro_batch=2, steps=6, device="cpu",
                           dropout=0.0, malloc="default", layers=8, overrides="")
    llama_bt = reference.command("bt", "llama", "full", a, "/w", True)
    llama_plain = reference.command("plain", "llama", "full", a, "/w", True)
    assert "model.n_layers=8" in llama_bt and "model.n_layers=4" not in llama_bt
    assert llama_plain[llama_plain.index("--layers") + 1] == "8"
    hf_bt = " ".join(reference.command("bt", "hf", "full", a, "/w", True))
    hf_plain = reference.command("plain", "hf", "full", a, "/w", True)
    assert "num_hidden_layers: 8" in hf_bt
    assert json.loads(hf_plain[hf_plain.index("--hf-config") + 1])["num_hidden_layers"] == 8
