"""The GPU check's long row (issue 44): its measured max_memory_allocated against the report's
prediction, printed as one line with the ratio and judged against the 10% goal; on CPU the
printing path, with figures made up here."""

from __future__ import annotations

from types import SimpleNamespace

from launch import gpu_check, gpu_table
from launch.gpu_bench import LONG_ROW

GIB = 2 ** 30


def _result(measured: int, predicted: int, mode: str = "gpu") -> dict:
    rows = {LONG_ROW: {"ok": True, "micro_batch": 1, "seq_len": 65536, "tokens_per_s": 1000.0,
                       "mfu": None, "peak_mem_bytes": measured, "peak_reserved_bytes": None,
                       "act_saved_bytes": None, "offloaded_bytes": None, "step_spread": 0.01}}
    compared = gpu_table.compare_predictions({LONG_ROW: {"predicted_peak": predicted}}, rows,
                                             "cuda" if mode == "gpu" else "cpu")
    return {"mode": mode, "started": "now", "seconds": {"bench": 1.0}, "total_seconds": 1.0,
            "stages": {"bench": {"ok": True, "rows": rows},
                       "predict": {"ok": True, "rows": compared}}}


def test_the_long_row_prints_measured_predicted_and_their_ratio() -> None:
    assert gpu_table.LONG_ROW == LONG_ROW  # the torch-free copy of the row's name
    line = gpu_table.long_row_line(_result(40 * GIB, 42 * GIB))
    assert line == ("long row (65536 tokens, micro-batch 1): measured max_memory_allocated "
                    "40.00 GiB, predicted 42.00 GiB, predicted/measured 1.050 (within the 10% "
                    "goal)")
    assert "NOT within" in gpu_table.long_row_line(_result(40 * GIB, 30 * GIB))
    assert gpu_table.long_row_line({"stages": {}}) is None  # no long row measured


def test_the_long_row_is_a_target_on_a_gpu_only() -> None:
    judged = {name: met for name, met, _ in gpu_table.targets(_result(40 * GIB, 42 * GIB))}
    assert judged[gpu_table.LONG_TARGET] is True
    judged = {name: met for name, met, _ in gpu_table.targets(_result(40 * GIB, 30 * GIB))}
    assert judged[gpu_table.LONG_TARGET] is False
    cpu = {name for name, _, _ in gpu_table.targets(_result(40 * GIB, 42 * GIB, "cpu"))}
    assert gpu_table.LONG_TARGET not in cpu  # RSS is not max_memory_allocated


def test_the_check_prints_the_long_row_line(tmp_path, capsys) -> None:
    check = SimpleNamespace(result=_result(40 * GIB, 38 * GIB))
    gpu_check._report(check, str(tmp_path))
    printed = capsys.readouterr().out
    assert ("[gpu_check] long row (65536 tokens, micro-batch 1): measured max_memory_allocated "
            "40.00 GiB, predicted 38.00 GiB, predicted/measured 0.950") in printed
    assert "0.950" in (tmp_path / "gpu_check.md").read_text()  # the row's ratio in the table
