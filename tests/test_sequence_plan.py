"""Planning with sequence tiles and a sequence degree (issue 38): auto picks the smallest tile
count (and degree) that fits and says why, --longest finds the longest length, the report
counts host memory, and the tile and all-to-all costs reach the step time. Tiny models on
meta; the agreement with measured CPU steps is tests/test_sequence_memory.py's."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import REPO, subprocess_env
from trainer.cli import check
from trainer.preflight.auto_plan import auto_table, decide, flop_timing, sequence_shapes
from trainer.preflight.longest import longest
from trainer.preflight.scenario import NOMINAL_ALL_TO_ALL_BYTES_PER_S, Evaluator, Scenario
from trainer.preflight.host_memory import host_lines, host_verdict

TINY = ["model.dropout=0", "data=synthetic", "data.seq_len=1024", "train.micro_batch_size=1",
        "model.ffn_hidden=1024", "checkpointing=full", "model.max_seq_len=4096"]


def _scenario(overrides: list[str], world: int = 1) -> Scenario:
    cfg, layout = check(overrides, {"WORLD_SIZE": str(world)})
    return Scenario(cfg, layout, world)


def test_auto_takes_the_fewest_tiles_that_fit_and_says_why_for_the_rest() -> None:
    evaluator = Evaluator(400)
    peaks = {t: evaluator.evaluate(_scenario(TINY + [f"checkpointing.tiles={t}"])
                                   ).estimate.peak.total for t in (1, 2, 4)}
    assert peaks[1] > peaks[2] > peaks[4]
    scenario = _scenario(TINY + ["checkpointing.tiles=auto"])
    capacity = (peaks[2] + peaks[4]) // 2  # 4 tiles fit, 2 do not
    decision = decide(scenario.cfg, scenario, evaluator, capacity, flop_timing(evaluator))
    assert decision.tiles == 4 and all(p.tiles == 4 for p in decision.plan)
    refused = [c for c in decision.candidates if c.plan == "refused"]
    assert [c.tiles for c in refused] == [1, 2] and all("least" in c.why for c in refused)
    assert "refused" not in auto_table(decision).splitlines()[1] and "4" in auto_table(decision)


def test_auto_sequence_degrees_divide_the_world_and_the_length() -> None:
    scenario = _scenario(TINY + ["sharding.sequence=auto"], world=4)
    assert sequence_shapes(scenario.cfg, scenario.layout) == [(1, 1, 1), (2, 1, 1), (4, 1, 1)]


def test_a_sequence_degree_divides_activations_and_costs_all_to_all_time() -> None:
    evaluator = Evaluator(400)
    alone, shared = (_scenario(TINY + [f"sharding.sequence={n}"], world=2) for n in (1, 2))
    one, two = evaluator.evaluate(alone), evaluator.evaluate(shared)
    assert two.estimate.activation_peak < 0.7 * one.estimate.activation_peak
    assert one.profile.sent_bytes_per_block == 0 < two.profile.sent_bytes_per_block
    timing = flop_timing(evaluator)(shared.cfg, shared, evaluator)[0]
    block = two.profile.blocks[0]
    exchange = two.profile.sent_bytes_per_block / NOMINAL_ALL_TO_ALL_BYTES_PER_S["node"]
    # Backward: 2 x the forward's matmuls, 2.5 x attention's (step_time.py)
    expected = ((3 * block.forward_flops + 0.5 * block.attention_flops)
                * evaluator.seconds_per_flop + 2 * exchange)
    assert abs(timing.block_compute[0] - expected) < 1e-12
    assert abs(timing.block_cost[0]["full"] - block.recompute_flops["full"]
               * evaluator.seconds_per_flop - exchange) < 1e-12


def test_tiles_add_one_mlp_forward_to_the_block_time() -> None:
    evaluator = Evaluator(400)
    plain, tiled = (_scenario(TINY + [f"checkpointing.tiles={t}"]) for t in (1, 4))
    measure = evaluator.evaluate(tiled).profile.blocks[0]
    assert measure.tile_flops > 0 and evaluator.evaluate(plain).profile.blocks[0].tile_flops == 0
    timing = flop_timing(evaluator)
    extra = (timing(tiled.cfg, tiled, evaluator)[0].block_compute[0]
             - timing(plain.cfg, plain, evaluator)[0].block_compute[0])
    # Attention is counted causally (step_time.py): the query tiles' causal rectangles hold the
    # same (query, key) pairs as the whole causal square, so the tiled forward counts the same.
    forward = measure.forward_flops - evaluator.evaluate(plain).profile.blocks[0].forward_flops
    assert forward == 0
    assert abs(extra - (measure.tile_flops + 3 * forward) * evaluator.seconds_per_flop) < 1e-12


def test_longest_finds_the_last_length_that_fits() -> None:
    tried = []

    def predict(scenario):
        tried.append(scenario.cfg.data.seq_len)
        return scenario.cfg.data.seq_len <= 5000, None, None

    found = longest(_scenario(TINY), predict)
    assert found.seq_len == 4096 and tried == [1024, 2048, 4096, 8192, 6144, 5120]


@pytest.mark.parametrize("shape", ["line", "convex", "steps"])
def test_the_guided_search_finds_what_bisection_finds_in_fewer_predictions(shape) -> None:
    """--longest guided by how much of its limit each length uses: the same last fitting length
    as doubling and bisection from every start, also where use is not a line."""
    curves = {"line": lambda n: 0.3 + n / 9000, "convex": lambda n: 0.2 + (n / 7000) ** 2,
              "steps": lambda n: 0.25 + (n // 100) * 100 / 6000}

    def search(start: int, guided: bool) -> tuple[int, int]:
        calls = []

        def predict(scenario):
            n = scenario.cfg.data.seq_len // 1024
            calls.append(n)
            return curves[shape](n) <= 1.0, n, None

        found = longest(_scenario([*TINY, "model.max_seq_len=67108864",
                                   f"data.seq_len={start * 1024}"]), predict,
                        use=(lambda n: curves[shape](n)) if guided else None)
        return found.seq_len, len(calls)

    plain, plain_calls = search(1, guided=False)
    assert curves[shape](plain // 1024) <= 1.0 < curves[shape](plain // 1024 + 1)
    for start in (1, 700, 5000, 9000, 60000):
        found, calls = search(start, guided=True)
        assert found == plain, (start, found, plain)
        assert calls <= plain_calls if shape == "steps" else calls < plain_calls, (start, calls)
        if shape == "line" and start > 1:  # the crossing, the step past it, one more at most
            assert calls <= 4 + (start > 9000) * 3, (start, calls)


def test_the_guided_search_on_a_tiny_model_finds_the_bisections_length() -> None:
    evaluator = Evaluator(400)
    base = [*TINY, "model.max_seq_len=65536", "checkpointing.head=chunked"]
    peak = lambda n: evaluator.evaluate(_scenario([*base, f"data.seq_len={n * 1024}"])
                                        ).estimate.peak.total
    capacity = (peak(11) + peak(12)) // 2

    def predict(scenario):
        outcome = evaluator.evaluate(scenario)
        return outcome.estimate.peak.total <= capacity, outcome, None

    use = lambda outcome: outcome.estimate.peak.total / capacity
    guided = longest(_scenario([*base, "data.seq_len=4096"]), predict, use=use)
    plain = longest(_scenario(base), predict)
    assert guided.seq_len == plain.seq_len == 11 * 1024
    assert len(guided.tried) < len(plain.tried)


def test_host_memory_of_offloaded_activations_is_counted_and_checked() -> None:
    outcome = Evaluator(400).evaluate(_scenario(TINY + ["offload=cpu", "offload.keep_last=0",
                                                  "offload.min_bytes=1024"]))
    moved = outcome.estimate.host_activations
    assert moved > 0
    pinned = host_verdict(outcome, None, None).per_node  # the pool's classes: at least moved
    assert pinned >= moved
    short = host_verdict(outcome, pinned // 2, reserve_gib=0)
    assert short.fits is False
    assert host_lines(short)[0].startswith("does NOT fit in host memory")
    assert host_lines(host_verdict(outcome, pinned * 2, 0))[0].startswith("host memory fits")


def test_auto_hands_the_build_a_concrete_degree_and_tile_count() -> None:
    from trainer.preflight.auto_plan import Decision
    from trainer.preflight.auto_run import chosen_config

    scenario = _scenario(TINY + ["checkpointing.tiles=auto", "sharding.sequence=auto",
                                 "train.global_batch_size=4"], world=2)
    decision = Decision(1, 4, [], 0, 0, 0.0, [], sequence=2, tiles=8)
    cfg = chosen_config(scenario.cfg, decision)
    assert (cfg.sharding.sequence, cfg.checkpointing.tiles, cfg.train.micro_batch_size) == (2, 8, 1)
    # What splits the work is the new layout auto's choice makes, not the one validation made.
    layout = scenario.layout.decided(decision.sequence, decision.micro_batch)
    assert scenario.layout.pending == ("sharding.sequence",)
    assert (layout.degree, layout.data_size, layout.grad_accum, layout.global_batch_size) == (
        2, 1, 4, 4)


@pytest.mark.parametrize("flag, value", [("--host-memory-gib", "0"), ("--longest-step", "0")])
def test_report_flags_for_long_sequences_refuse_bad_values_in_one_line(flag, value) -> None:
    result = subprocess.run([sys.executable, "-m", "trainer.report", flag, value], cwd=REPO,
                            env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        result.stderr.strip()] and flag in result.stderr and "Traceback" not in result.stderr
