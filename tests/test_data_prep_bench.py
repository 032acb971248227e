"""The data preparation benchmark (launch/bench/data_prep.py) runs end to end at a tiny size:
every contender timed, ours making exactly the plain library call's tokens, the verdict lines
printed (its figures are for an idle machine, not checked here)."""

from __future__ import annotations


def test_the_benchmark_runs_and_ours_makes_the_plain_calls_tokens(capsys) -> None:
    from launch.bench.data_prep import main

    results = main(["--chats", "40", "--texts", "40", "--vocab", "600", "--repeats", "1",
                    "--only", "chatml,text", "--before", "5"])
    assert set(results) == {"chatml", "text"}
    for name, rows in results.items():
        expected = {"plain", "ours_1", "ours_2", "ours_1t", "whole_1", "whole_2"}
        assert expected | ({"before"} if name == "chatml" else set()) == set(rows)
        for label in ("ours_1", "ours_2", "ours_1t"):
            assert rows[label]["same"] == "yes", (name, label)
        assert 0 < rows["whole_1"]["tokens"] == rows["whole_2"]["tokens"]
        assert all(row["s"] > 0 for row in rows.values())
    out = capsys.readouterr().out
    assert "ours_1 over plain (target >= 50% each)" in out
    assert "the whole preparation (read, tokenize, pack, write), num_proc 2 over 1" in out
