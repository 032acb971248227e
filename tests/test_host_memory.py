"""Host memory as a verdict (trainer/preflight/host_memory.py): the pinned pool's size classes
counted as the pool allocates them, a reserve left to the node, the report's exit status (0 fits,
3 does not, device or host; 2 bad input) and the trainer's refusal at start."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from offload.cuda import PinnedPool
from tests.helpers import subprocess_env
from tests.test_report import TINY
from trainer.cli import check
from trainer.config import ConfigError
from trainer.preflight.host_memory import (GIB, check_node, host_verdict, pinned_activation_bytes,
                                           reserve_bytes)
from trainer.preflight.scenario import Evaluator, Scenario

# Every block offloaded, storages of odd sizes (seq 96: none is a power of two).
OFFLOADED = [*TINY, "data.seq_len=96", "offload=cpu", "offload.keep_last=0",
             "offload.min_bytes=1024", "checkpointing=none"]


def _outcome(overrides: list[str], world: int = 1, per_node: int = 1):
    cfg, layout = check(overrides, {"WORLD_SIZE": str(world)})
    return Evaluator(400).evaluate(Scenario(cfg, layout, per_node))


def test_pinned_bytes_are_what_the_pool_allocates_for_the_plans_storages() -> None:
    outcome = _outcome(OFFLOADED)
    pool = PinnedPool(1 << 40, allocate=lambda n: None)
    for measure, step in zip(outcome.profile.blocks, outcome.plan):
        for n in measure.storage_sizes[step.recompute]:
            if n >= 1024:  # what the offloader moves; all out at once by the forward's end
                assert pool.acquire(n) is not None
    exact = outcome.estimate.host_activations
    assert pinned_activation_bytes(outcome) == pool.allocated_bytes > exact > 0
    # The pool's bound caps it: what does not fit stays on the device.
    capped = _outcome([*OFFLOADED, f"offload.max_host_bytes={exact // 2}"])
    assert pinned_activation_bytes(capped) == exact // 2


def test_the_reserve_is_a_tenth_of_the_node_unless_given_and_must_leave_something() -> None:
    assert reserve_bytes(100 * GIB, None) == 10 * GIB
    assert reserve_bytes(100 * GIB, 30) == 30 * GIB
    with pytest.raises(ConfigError) as exc:
        reserve_bytes(100 * GIB, 100)
    assert exc.value.key == "train.host_reserve_gib"


def test_host_verdict_per_node_against_the_node_less_its_reserve() -> None:
    outcome = _outcome(OFFLOADED, world=4, per_node=4)
    per_node = host_verdict(outcome, None, None).per_node
    assert per_node == 4 * pinned_activation_bytes(outcome)
    assert host_verdict(outcome, None, None).fits is None  # no host given: not judged
    # 10% reserved by default: a node of 1.05 x the need fits with no reserve only.
    node = int(per_node * 1.05)
    assert host_verdict(outcome, node, 0).fits is True
    assert host_verdict(outcome, node, None).fits is False


def _report(tmp_path, *args: str) -> subprocess.CompletedProcess:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, "-m", "trainer.report", *args, "--out",
                           str(tmp_path)], cwd=tmp_path, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)


def test_report_exit_status_and_verdicts_device_and_host(tmp_path) -> None:
    base = [*OFFLOADED, "train.memory_reserve_gib=0"]
    pinned = host_verdict(_outcome(OFFLOADED), None, None).per_node
    cases = {  # (host GiB, GPU GiB) -> exit status, fits, device_fits, host_fits
        "fits": (2 * pinned / GIB, 1.0, 0, True, True, True),
        "host": (pinned / 2 / GIB, 1.0, 3, False, True, False),
        "device": (2 * pinned / GIB, 0.001, 3, False, False, True),
    }
    for name, (host, gpu, status, fits, device_fits, host_fits) in cases.items():
        out = tmp_path / name
        result = _report(out, *base, "--host-memory-gib", f"{host:.9f}", "--gpu-memory-gib",
                         str(gpu), "train.host_reserve_gib=0")
        assert result.returncode == status, (name, result.stdout[-2000:], result.stderr[-2000:])
        data = json.loads((out / "memory_plan.json").read_text())
        assert (data["fits"], data["device_fits"], data["host_fits"]) == (
            fits, device_fits, host_fits), name
        assert ("does NOT fit in host memory" in result.stdout) == (not host_fits), name
        assert data["host"]["pinned_per_node_bytes"] == pinned


@pytest.mark.parametrize("args,start", [
    (["--host-memory-gib", "0"], "error: --host-memory-gib: must be > 0"),
    (["--host-memory-gib", "-3"], "error: --host-memory-gib: must be > 0"),
    (["--host-memory-gib", "10", "train.host_reserve_gib=10"],
     "error: train.host_reserve_gib: 10.0 GiB leaves nothing"),
    (["train.host_reserve_gib=-1"], "error: train.host_reserve_gib: must be null or >= 0"),
])
def test_bad_host_input_is_one_line_and_exit_2(tmp_path, args, start) -> None:
    result = _report(tmp_path, *TINY, *args)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(start), result.stderr
    assert result.stdout == ""


def test_the_trainer_refuses_a_plan_that_pins_more_than_the_node() -> None:
    cfg, layout = check([*OFFLOADED, "offload.max_host_bytes=1000000000000"],
                        {"WORLD_SIZE": "4"})
    pinned = host_verdict(Evaluator(1.0).evaluate(Scenario(cfg, layout, 4)), None, None)
    with pytest.raises(ConfigError) as exc:  # the pool's bound alone exceeds it: planned
        check_node(cfg, layout, 4, "cuda", node_bytes=pinned.per_node)  # 10% reserved
    assert exc.value.key == "offload.max_host_bytes" and "per node" in str(exc.value)
    check_node(cfg, layout, 4, "cuda", node_bytes=2 * pinned.per_node)  # the plan fits
    check_node(cfg, layout, 4, "cpu", node_bytes=1)  # a CPU run pins nothing
