"""train.compile=true (inductor on CPU) with every recompute policy and offload target, the
compiler's own placement (checkpointing=compiler), what compiled blocks keep, and start-up."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.distributed.tensor import DTensor

from checkpointing.compiled import graphs_compiled
from checkpointing.plan import block_rows
from checkpointing.meter import SavedBytesMeter, is_parameter_like
from tests.checkpoint_harness import SMALL, train_steps
from tests.dist import spawn
from tests.helpers import QUICK, check_ok, config, read_metrics, run_trainer, layout_of
from trainer.build import build_model
from trainer.distenv import read_env

COMPILED = ["train.compile=true", "offload.min_bytes=0", "offload.keep_last=1"]
# The budget is a fraction of *compiled* no-checkpoint bytes, which are fewer than eager ones.
POLICIES = [["checkpointing=none"], ["checkpointing=full"], ["checkpointing=every_k"],
            ["checkpointing=sqrt"], ["checkpointing=selective"],
            ["checkpointing=budget", "checkpointing.budget=0.6"],
            ["checkpointing=compiler", "checkpointing.budget=0.4"]]
TARGETS = ("none", "cpu", "disk")


def _steps(overrides: list[str], run_dir: str, rank: int, steps: int = 3, blocks: int = 4):
    cfg = config(*SMALL, *COMPILED, *overrides)
    meter = SavedBytesMeter()
    torch.manual_seed(7 + rank)
    # Planner timings are given (tests/conftest.py): checkpointing=budget chooses the compiler's
    # placement, whatever the machine's load.
    built = build_model(cfg, read_env("cpu"), layout=layout_of(cfg), meter=meter, run_dir=run_dir)
    assert built.compiled_blocks == blocks
    losses, grads, offloaded = train_steps(built, meter, cfg.optim, steps, rank)
    return losses, grads, meter.peak, offloaded, [(p.recompute, p.memory_budget)
                                                  for p in built.plan]


def _grid(rank: int, world_size: int, run_dir: str, extra: list[str],
          targets: tuple = TARGETS):
    return {(p[0], target): _steps([*p, *extra, f"offload={target}"],
                                   os.path.join(run_dir, f"r{rank}"), rank)
            for p in POLICIES for target in targets}


def _check(results: dict, dropout: bool) -> None:
    ref_losses, ref_grads = results["checkpointing=none", "none"][:2]
    for (policy, target), (losses, grads, saved, offloaded, plan) in results.items():
        if policy == "checkpointing=compiler":
            assert {r for r, _ in plan} == {"compiler"}
            assert all(0 <= budget < 1 for _, budget in plan)
        if dropout and any(r == "compiler" for r, _ in plan):  # the budget planner may choose it
            # The compiler's placement changes how inductor draws its dropout seeds: the first
            # step (same weights, same masks) is bitwise, later ones draw other masks.
            assert torch.equal(losses[0], ref_losses[0]), target
        else:
            assert torch.equal(losses, ref_losses), (policy, target)
            for name, grad in grads.items():
                assert torch.equal(grad, ref_grads[name]), (policy, target, name)
        if target == "disk":
            assert offloaded > 0, policy
            if plan == results[policy, "none"][4]:  # what went to disk is no longer kept
                assert saved < results[policy, "none"][2], policy


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", "qwen3_tiny"])
def test_every_policy_and_target_bitwise_compiled_one_rank(world_of_one, tmp_path, model) -> None:
    # offload=cpu on a CPU device runs the hooks but moves nothing, whatever the model: the tiny
    # Llama covers it; Qwen3's blocks run every policy kept and on disk.
    targets = TARGETS if model == "tiny" else ("none", "disk")
    _check(_grid(0, 1, str(tmp_path), [f"model={model}", "model.dropout=0.1"], targets),
           dropout=True)
    assert not any(files for _, _, files in os.walk(tmp_path))  # every offload file is gone


@pytest.mark.slow
def test_every_policy_and_target_bitwise_compiled_two_ranks(tmp_path) -> None:
    # offload=cpu on a CPU device runs the hooks but moves nothing: one rank covers it.
    for results in spawn(_grid, 2, str(tmp_path), ["model.dropout=0.1"], ("none", "disk")):
        _check(results, dropout=True)


@pytest.mark.slow
def test_compiler_placement_is_bitwise_without_dropout(world_of_one, tmp_path) -> None:
    results = {}
    for p in (["checkpointing=none"], ["checkpointing=compiler", "checkpointing.budget=0.2"],
              ["checkpointing=compiler", "checkpointing.budget=0.7"],
              ["checkpointing=budget", "checkpointing.budget=0.6"]):
        results[p[-1], "none"] = _steps([*p, "model.dropout=0.0"], str(tmp_path), 0)
    _check({("checkpointing=none", "none"): results["checkpointing=none", "none"],
            **{("compiler " + k, t): v for (k, t), v in results.items()}}, dropout=False)
    # A smaller budget keeps fewer bytes, and both fewer than without checkpointing.
    saved = {k: v[2] for (k, _), v in results.items()}
    assert saved["checkpointing.budget=0.2"] < saved["checkpointing.budget=0.7"] < \
        saved["checkpointing=none"]


@pytest.mark.slow
def test_more_kinds_of_blocks_than_the_recompile_limit(world_of_one, tmp_path) -> None:
    """Five kinds of block in one model (none, full, selective, compiler at two budgets) under a
    recompile limit of 1 per code object (dynamo's default is 8; lowered so that five kinds are
    more than it) and failing if it is reached: each kind compiles through its own entry, once,
    and trains bit for bit as checkpointing=none. Through one shared function the checkpointed
    blocks met the limit, fell back to eager and failed in backward."""
    import torch._dynamo

    kinds = [{"recompute": "none"}, {"recompute": "full"}, {"recompute": "selective"},
             {"recompute": "compiler", "memory_budget": 0.2},
             {"recompute": "compiler", "memory_budget": 0.6}]
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps([{"index": i, "name": f"layers.{i}", **kind}
                                     for i, kind in enumerate(kinds)]))
    common = ["model.n_layers=5", "model.dropout=0.0", "model.dim=48"]
    before = graphs_compiled()
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        mixed = _steps([*common, "checkpointing=file", f"checkpointing.plan_file={plan_file}"],
                       str(tmp_path), 0, steps=2, blocks=5)
        graphs = graphs_compiled() - before
        torch._dynamo.reset()
        none = _steps([*common, "checkpointing=none"], str(tmp_path), 0, steps=2, blocks=5)
    assert [(r, b) for r, b in mixed[4]] == [(k["recompute"], k.get("memory_budget"))
                                             for k in kinds]
    assert graphs == len(kinds)  # one graph per kind, none twice
    assert torch.equal(mixed[0], none[0])
    for name, grad in mixed[1].items():
        assert torch.equal(grad, none[1][name]), name


def _graph_saved_bytes(loss: torch.Tensor, params: frozenset = frozenset()) -> int:
    """Bytes of distinct non-parameter storages the autograd graph holds for backward, read off
    the graph itself: compiled blocks are nodes whose `saved_tensors` are what their compiled
    backward keeps."""
    seen, total, stack, visited = set(), 0, [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        tensors = list(getattr(node, "saved_tensors", None) or ())
        tensors += [getattr(node, a) for a in dir(node) if a.startswith("_saved_")]
        for t in tensors:
            if isinstance(t, torch.Tensor) and not is_parameter_like(t):
                key = t.untyped_storage()._cdata
                if key not in seen and key not in params:
                    seen.add(key)
                    total += t.untyped_storage().nbytes()
        stack.extend(n for n, _ in node.next_functions)
    return total


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_saved_bytes_are_what_the_compiled_backward_keeps(world_of_one, tmp_path, policy) -> None:
    from trainer.models.llama import lm_loss
    from tests.checkpoint_harness import token_batch

    cfg = config(*SMALL, "train.compile=true", "model.dropout=0.0", f"checkpointing={policy}",
                 "checkpointing.profile=true")
    meter = SavedBytesMeter()
    built = build_model(cfg, read_env("cpu"), layout=layout_of(cfg), meter=meter, run_dir=str(tmp_path))
    inputs, targets = token_batch(0, 0)
    with meter.measure():
        loss = lm_loss(built.model, inputs, targets)
    # FSDP keeps the last block's unsharded parameters after forward (its backward comes first);
    # its matmuls saved them, and they are parameters, not activations.
    params = {p.untyped_storage()._cdata for p in built.model.parameters()
              if not isinstance(p, DTensor)}
    assert meter.bytes == _graph_saved_bytes(loss, params) > 0
    loss.backward()
    if policy == "selective":  # inside the graph its cache is saved tensors, and counted
        assert meter.bytes > built.profiles[0].saved_bytes["full"] * 4


@pytest.mark.slow
def test_identical_blocks_compile_once(world_of_one, tmp_path) -> None:
    from trainer.models.llama import lm_loss
    from tests.checkpoint_harness import token_batch

    for layers, policy in ((4, "none"), (8, "none"), (8, "full")):
        cfg = config(*SMALL, "train.compile=true", f"model.n_layers={layers}",
                     f"checkpointing={policy}", "model.dim=48")
        built = build_model(cfg, read_env("cpu"), layout=layout_of(cfg), meter=SavedBytesMeter(),
                            run_dir=str(tmp_path))
        before = graphs_compiled()
        lm_loss(built.model, *token_batch(0, 0)).backward()
        # One graph for the blocks; a new model width makes the first build compile it once.
        assert graphs_compiled() - before <= 1, (layers, policy)


@pytest.mark.slow
def test_compiled_run_reports_start_up_and_compiler_budget(tmp_path) -> None:
    run_dir = tmp_path / "run"
    result = run_trainer(QUICK + ["train.steps=2", "train.compile=true", "checkpointing=compiler",
                                  "checkpointing.budget=0.3", "checkpointing.profile_repeats=1",
                                  "offload=disk", f"hydra.run.dir={run_dir}"], cwd=tmp_path,
                         nproc=2, timeout=600)
    check_ok(result)
    startup = [m for m in read_metrics(run_dir) if "to_first_step_s" in m]
    assert len(startup) == 1 and startup[0]["step"] == 1 and "loss" in startup[0]
    assert startup[0]["to_first_step_s"] >= startup[0]["build_s"] > 0
    assert startup[0]["compiled_graphs"] >= 1
    assert "start-up: " in (run_dir / "train.log").read_text()
    plan = block_rows(json.loads((run_dir / "plan.json").read_text()))
    assert {p["recompute"] for p in plan} == {"compiler"}
    assert all(0 <= p["memory_budget"] < 1 for p in plan)


def test_compiler_policy_needs_compile(tmp_path) -> None:
    result = run_trainer(QUICK + ["checkpointing=compiler", "train.compile=false",
                                  f"hydra.run.dir={tmp_path / 'r'}"],
                         cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [errors[0]] and errors[0].startswith("error: train.compile")


def test_compiler_budget_is_the_same_share_of_no_checkpoint_bytes() -> None:
    from checkpointing.planner.policies import Budget, BudgetError, choose_plan, compiler_budgets
    from checkpointing.planner.profile import BlockProfile

    def profile(none: int, full: int) -> BlockProfile:
        return BlockProfile(saved_bytes={"none": none, "selective": none // 2, "full": full},
                            cost_s={"none": 0.0, "selective": 0.1, "full": 0.2})

    profiles = [profile(100, 10), profile(100, 10), profile(200, 20)]
    # Half of the 400 block bytes (plus 50 outside them): each block keeps half of its own, so
    # r = (0.5 none - full) / (none - full) = 40 / 90.
    assert compiler_budgets(profiles, Budget(250, 450), rest_bytes=50) == [0.4444] * 3
    assert compiler_budgets(profiles, Budget(450, 450), 50) == [1.0] * 3
    assert compiler_budgets(profiles, Budget(90, 450), 50) == [0.0] * 3  # exactly the inputs
    with pytest.raises(BudgetError, match="smallest feasible budget is 90 bytes"):
        compiler_budgets(profiles, Budget(89, 450), 50)
    plan = choose_plan("compiler", ["a", "b", "c"], True, profiles=profiles, rest_bytes=50,
                       budget=Budget(250, 450))
    assert [(p.recompute, p.memory_budget) for p in plan] == [("compiler", 0.4444)] * 3


def test_budget_planner_can_choose_the_compilers_placement() -> None:
    from dataclasses import replace

    from checkpointing.planner.policies import Budget, choose_plan
    from checkpointing.planner.profile import BlockProfile

    plain = BlockProfile(saved_bytes={"none": 100, "selective": 60, "full": 10},
                         cost_s={"none": 0.0, "selective": 0.3, "full": 0.5},
                         working_bytes={"none": 100, "selective": 60, "full": 30})
    # Keeps less than selective for less time: the cheapest plan under the budget uses it.
    with_compiler = replace(plain, saved_bytes={**plain.saved_bytes, "compiler": 50},
                            cost_s={**plain.cost_s, "compiler": 0.1}, compiler_budget=0.4444,
                            working_bytes={**plain.working_bytes, "compiler": 50})
    plan = choose_plan("budget", ["a", "b"], True, profiles=[with_compiler] * 2, rest_bytes=0,
                       budget=Budget(120, 200))
    assert [(p.recompute, p.memory_budget) for p in plan] == [("compiler", 0.4444)] * 2
    plan = choose_plan("budget", ["a", "b"], True, profiles=[plain] * 2, rest_bytes=0,
                       budget=Budget(120, 200))
    assert {p.recompute for p in plan} <= {"none", "selective", "full"}


def test_plan_file_with_compiler_blocks_needs_compile(tmp_path) -> None:
    from trainer.config import ConfigError
    from trainer.state.planfile import read_plan

    path = tmp_path / "plan.json"
    rows = [{"index": i, "name": f"layers.{i}", "recompute": "compiler", "memory_budget": 0.3}
            for i in range(2)]
    path.write_text(json.dumps(rows))
    plan = read_plan(str(path), ["layers.0", "layers.1"], True, compiled=True)
    assert [(p.recompute, p.memory_budget) for p in plan] == [("compiler", 0.3)] * 2
    with pytest.raises(ConfigError, match="set train.compile=true"):
        read_plan(str(path), ["layers.0", "layers.1"], True, compiled=False)
    path.write_text(json.dumps([{**r, "memory_budget": None} for r in rows]))
    with pytest.raises(ConfigError, match="memory_budget between 0 and 1"):
        read_plan(str(path), ["layers.0", "layers.1"], True, compiled=True)


def test_a_plan_with_compiler_blocks_is_predicted_as_keeping_everything(tmp_path) -> None:
    """The report (and the dashboard's prediction) bound a compiler-placed block by `none`."""
    from checkpointing.plan import BlockPlan
    from trainer.cli import check
    from trainer.preflight.plot import plot_plan
    from trainer.preflight.scenario import Evaluator, Scenario

    cfg, layout = check(["data.seq_len=64", "train.micro_batch_size=4", "train.device=cpu"],
                        {"WORLD_SIZE": "1"})
    evaluator, scenario = Evaluator(1.0, device_type="cpu"), Scenario(cfg, layout, 1)
    plan = [BlockPlan(i, f"layers.{i}", recompute="compiler", memory_budget=0.3)
            for i in range(4)]
    compiled, none = evaluator.evaluate(scenario, plan), evaluator.evaluate(scenario)
    assert compiled.estimate.peak.total == none.estimate.peak.total
    assert {p.recompute for p in compiled.plan} == {"none"}
    plot_plan(compiled, str(tmp_path / "memory_plan.png"))
    assert (tmp_path / "memory_plan.png").stat().st_size > 0
