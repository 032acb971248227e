"""The GPU check's bench stage under a time budget, on CPU (issue 29, items 2 and 6).

Rows are played by a stand-in that takes simulated seconds, so the budget's arithmetic is exact:
which rows run, at which micro-batch, which are skipped, what a second call with --resume runs.
"""

from __future__ import annotations

import json
import time

from launch import gpu_bench, gpu_check, gpu_table

ROW_S = 40.0  # simulated seconds per row, within GPU's row_min_s..row_cap
MICRO_BATCH, SEQ, LAYERS, DIM = 16, 4096, 16, 2048


class Bench:
    """A GPU-mode Check whose clock and rows are simulated."""

    def __init__(self, tmp_path, monkeypatch, budget_s: float, previous: dict = None,
                 out_of_memory: tuple = ()) -> None:
        self.now = 1000.0
        self.calls: list[tuple[str, int]] = []
        self.out_of_memory = out_of_memory
        monkeypatch.setattr(time, "monotonic", lambda: self.now)
        monkeypatch.setattr(gpu_bench, "bench_row", self.row)
        self.check = gpu_check.Check(gpu_check.GPU, str(tmp_path / "out"),
                                     str(tmp_path / "work"), {}, budget_s, previous)
        self.check.result["stages"]["fit"] = {
            "ok": True, "micro_batch": MICRO_BATCH, "seq_len": SEQ, "model_dim": DIM,
            "model_layers": LAYERS, "long": {"seq_len": 4 * SEQ, "host_activations": 0},
            "row_micro_batch": {
                n: MICRO_BATCH for n in gpu_bench.ROWS if not n.startswith("ref:")}}

    def row(self, check, name: str, micro_batch: int, seq_len: int, cap: float) -> dict:
        self.calls.append((name, micro_batch))
        if cap < ROW_S:  # stopped at its cap, as Check.run does
            self.now += cap
            return {"ok": False, "micro_batch": micro_batch, "exit_status": 124,
                    "error": "exit status 124: [stopped at its cap]"}
        self.now += ROW_S
        if name in self.out_of_memory:  # what bench_row returns after halving
            micro_batch //= 2
        block_input = micro_batch * seq_len * DIM * 2
        kept = 2 if "offload" in name else LAYERS
        return {"ok": True, "micro_batch": micro_batch, "seq_len": seq_len,
                "tokens_per_s": 1000.0 * micro_batch, "mfu": 0.5, "step_spread": 0.01,
                "peak_mem_bytes": 10 ** 10 + kept * block_input, "peak_reserved_bytes": None,
                "device_used_bytes": None, "act_saved_bytes": 0, "offloaded_bytes": 0,
                "losses": [1.0]}

    def run(self) -> dict:
        self.check.stage("bench", lambda cap: gpu_bench.stage_bench(self.check, cap))
        return self.check.result["stages"]["bench"]


def test_a_reference_row_runs_at_its_trainer_rows_final_micro_batch(tmp_path, monkeypatch):
    bench = Bench(tmp_path, monkeypatch, float("inf"), out_of_memory=("selective",))
    rows = bench.run()["rows"]
    calls = dict(bench.calls)
    assert calls["selective"] == MICRO_BATCH
    assert rows["selective"]["micro_batch"] == MICRO_BATCH // 2
    assert calls["ref:selective"] == MICRO_BATCH // 2  # not the planned 16
    assert calls["ref:full"] == rows["full"]["micro_batch"] == MICRO_BATCH
    (g1,) = [met for name, met, _ in gpu_table.targets(bench.check.result)
             if name.startswith("G1")]
    assert g1 is not None  # the pair is comparable


def test_rows_with_no_time_are_skipped_and_every_target_still_judged(tmp_path, monkeypatch):
    # Time for five rows and a part of a sixth, after what the later stages keep.
    budget = gpu_bench.AFTER_BENCH_S + 5 * ROW_S + 35
    bench = Bench(tmp_path, monkeypatch, budget)
    stage = bench.run()
    names = list(gpu_bench.ROWS)
    assert [name for name, _ in bench.calls] == names[:6]
    assert stage["ok"] and stage["skipped"] == names[5:]
    assert "stopped when the check's budget" in stage["rows"][names[5]]["skipped"]
    assert all("not run" in stage["rows"][n]["skipped"] for n in names[6:])
    # Rows in order of value: five rows are enough to judge G1, G2 and auto.
    judged = {name[:4]: met for name, met, _ in gpu_table.targets(bench.check.result)}
    assert judged["G1: "] is not None and judged["G2: "] is not None
    assert judged["auto"] is not None
    markdown = gpu_table.markdown({**bench.check.result, "started": "now"})
    assert f"| {names[-1]} |  | skipped: not run" in markdown


def test_resume_measures_only_the_rows_a_first_call_skipped(tmp_path, monkeypatch):
    first = Bench(tmp_path / "1", monkeypatch, gpu_bench.AFTER_BENCH_S + 4 * ROW_S + 10)
    earlier = first.run()
    assert len(first.calls) == 4 and len(earlier["skipped"]) == len(gpu_bench.ROWS) - 4
    second = Bench(tmp_path / "2", monkeypatch, float("inf"), previous=first.check.result)
    rows = second.run()["rows"]
    assert [name for name, _ in second.calls] == earlier["skipped"]
    assert list(rows) == list(gpu_bench.ROWS) and all(r["ok"] for r in rows.values())
    assert all(rows[n] == earlier["rows"][n] for n, _ in first.calls)


def test_resume_keeps_stages_that_were_ok_and_runs_the_rest(tmp_path) -> None:
    previous = {"stages": {"env": {"ok": True, "cuda": True}, "cuda_tests": {"ok": False}}}
    check = gpu_check.Check(gpu_check.GPU, str(tmp_path / "out"), str(tmp_path / "work"), {},
                            previous=previous)
    assert check.keep("env") and check.result["stages"]["env"] == previous["stages"]["env"]
    assert not check.keep("cuda_tests")  # failed before: runs again
    assert not check.keep("bench") and not check.keep("predict")  # they go on


def test_resume_from_a_file_that_is_not_there_names_the_flag(tmp_path, capsys) -> None:
    status = gpu_check.main(["--resume", str(tmp_path / "missing.json"), "--out",
                             str(tmp_path / "out"), "--cpu-smoke", "--stages", "env"])
    assert status == 2 and capsys.readouterr().err.startswith("error: --resume ")


def test_resume_cli_keeps_an_earlier_ok_stage_without_running_it(tmp_path, capsys) -> None:
    earlier = {"stages": {"env": {"ok": True, "cuda": False, "torch": "earlier"}},
               "seconds": {"env": 4.0}}
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps(earlier))
    status = gpu_check.main(["--cpu-smoke", "--resume", str(path), "--stages", "env", "--out",
                             str(tmp_path / "out"), "--work", str(tmp_path / "work")])
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert status == 0 and report["stages"]["env"]["torch"] == "earlier"
    assert report["resumed_from"] == str(path) and "kept from --resume" in capsys.readouterr().out
