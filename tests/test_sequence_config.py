"""sharding.sequence and checkpointing.tiles before anything runs (issue 38): every mistake one
line naming the key, before any process group (validate never imports torch; the meta-model
checks in the pre-flight); the layout counting samples; the plan carrying tiles (with_tiles, the
table, a plan file); the Data's slices, without processes. Whole runs: test_sequence_runs.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from checkpointing.plan import BlockPlan, describe, plan_table, plan_to_json, with_tiles
from sharding.layout import mesh_layout
from tests.helpers import REPO, config, sampling, subprocess_env
from trainer.cli import check
from trainer.config import ConfigError
from trainer.models.families import family_named
from trainer.preflight.precheck import deep_check

HF = ("model.hf_config={model_type: llama, vocab_size: 256, hidden_size: 32, "
      "intermediate_size: 48, num_hidden_layers: 2, num_attention_heads: 4, "
      "num_key_value_heads: %d}")


@pytest.mark.parametrize("overrides, world, says", [
    (["sharding.sequence=0"], 2, "sharding.sequence: must be a positive integer or auto, got 0"),
    (["sharding.sequence=two"], 2, "sharding.sequence: must be a positive integer or auto"),
    (["sharding.sequence=true"], 2, "sharding.sequence: must be a positive integer or auto"),
    (["sharding.sequence=2", "sharding=none"], 2, "sharding.sequence: 2 needs sharding=fsdp or "
     "hsdp"),
    (["sharding.sequence=3"], 3, "sharding.sequence: sequence degree 3 must divide the "
     "attention heads 4"),
    (["sharding.sequence=4", "model.n_heads=4"], 2, "sharding.sequence: sequence degree 4 must "
     "divide the world size 2"),
    (["sharding.sequence=2", "sharding=hsdp", "sharding.replicate=2"], 2, "sharding.sequence: "
     "sequence degree 2 must divide the ranks per replica 1"),
    (["sharding.sequence=2", "data.seq_len=63"], 2, "sharding.sequence: 2 must divide "
     "data.seq_len=63"),
    (["sharding.sequence=2", "model=vit_tiny"], 2, "sharding.sequence: model.arch=vit has no "
     "sequence parallelism"),
    # KV heads it does not divide are repeated (issue 45); the query heads bound it
    (["sharding.sequence=3", "model=hf", HF % 1], 3, r"sharding.sequence: sequence degree 3 "
     r"must divide the attention heads 4.*\(the HF model's attention heads 4, KV heads 1\)"),
    (["sharding.sequence=2", "model=hf", HF % 2, "model.attn_implementation=flex_attention"], 2,
     "model.attn_implementation: 'flex_attention' cannot run sequence-parallel"),
    (["sharding.sequence=2", "train.global_batch_size=3", "train.micro_batch_size=1"], 4,
     r"train.global_batch_size: 3 is not divisible by train.micro_batch_size x \(world size / "
     r"sharding.sequence=2\) = 1 x 2"),
    (["checkpointing.tiles=0"], 1, "checkpointing.tiles: must be a positive integer or auto"),
    (["checkpointing.tiles=1.5"], 1, "checkpointing.tiles: must be a positive integer or auto"),
    (["checkpointing.tiles=65", "data.seq_len=64"], 1, r"checkpointing.tiles: 65 tiles for the "
     r"64 tokens a rank holds \(data.seq_len=64\)"),
    (["checkpointing.tiles=33", "data.seq_len=64", "sharding.sequence=2"], 2,
     r"checkpointing.tiles: 33 tiles for the 32 tokens a rank holds \(data.seq_len=64 / "
     r"sharding.sequence=2\)"),
    (["checkpointing.tiles=2", "model=vit_tiny"], 1, "checkpointing.tiles: model.arch=vit has "
     "no token-wise MLP"),
])
def test_each_mistake_is_one_line_naming_the_key(overrides, world, says) -> None:
    with pytest.raises(ConfigError, match="^" + says):
        check(overrides, {"WORLD_SIZE": str(world)})


def test_good_settings_pass_and_auto_waits_for_the_planner() -> None:
    check(["sharding.sequence=2", "checkpointing.tiles=32", "data.seq_len=64"], {"WORLD_SIZE": "2"})
    check(["sharding.sequence=2", "model.n_kv_heads=1"], {"WORLD_SIZE": "2"})  # KV repeated
    check(["sharding.sequence=2", "model=hf", HF % 2], {"WORLD_SIZE": "4"})
    _, layout = check(["sharding.sequence=auto", "checkpointing.tiles=auto"], {"WORLD_SIZE": "2"})
    assert layout.sequence == "auto" and layout.pending == ("sharding.sequence",)
    with pytest.raises(ValueError, match="^sharding.sequence: auto is chosen"):
        layout.data_size  # nothing splits the ranks by a degree not chosen yet


def test_the_global_batch_counts_samples_once() -> None:
    _, layout = check(["sharding.sequence=2", "train.micro_batch_size=2",
                       "train.global_batch_size=8"], {"WORLD_SIZE": "4"})
    # 4 ranks in 2 groups of 2: each group reads 2 samples a micro-step, 4 micro-steps.
    assert (layout.sequence, layout.data_size, layout.grad_accum,
            layout.global_batch_size) == (2, 2, 2, 8)
    _, plain = check(["train.micro_batch_size=2", "train.grad_accum=3"], {"WORLD_SIZE": "4"})
    assert (plain.sequence, plain.global_batch_size) == (1, 24)
    _, grouped = check(["sharding.sequence=4", "train.micro_batch_size=2", "train.grad_accum=3"],
                       {"WORLD_SIZE": "4"})
    assert grouped.global_batch_size == 6


def test_the_validator_does_not_import_torch() -> None:
    code = ("import sys; from trainer.cli import check; "
            "check(['sharding.sequence=2', 'checkpointing.tiles=4'], {'WORLD_SIZE': '2'}); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(), check=True)


@pytest.mark.parametrize("override, says", [
    ("sharding.sequence=3", "error: sharding.sequence: sequence degree 3 must divide the "
     "attention heads 4"),
    ("checkpointing.tiles=0", "error: checkpointing.tiles: must be a positive integer or auto"),
])
def test_the_trainer_prints_one_line_and_exits_2(override, says, tmp_path) -> None:
    result = subprocess.run([sys.executable, "-m", "trainer", override, "logging.wandb=false"],
                            cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True,
                            timeout=120)
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert result.returncode == 2 and lines == [lines[-1]], result.stderr[-2000:]
    assert lines[-1].startswith(says)
    assert not (tmp_path / "outputs").exists()  # nothing written


def test_the_meta_checks_name_the_key() -> None:
    # Heads the fields do not name are read from the built config.
    m = config("model=hf", "model.hf_config={model_type: llama, vocab_size: 64, hidden_size: 32, "
               "intermediate_size: 48, num_hidden_layers: 2}", "sharding.sequence=8",
               "data.seq_len=64")  # transformers' default: 32 heads, KV heads as many
    deep_check(m, mesh_layout("fsdp", 8, sequence=8))
    with pytest.raises(ConfigError, match=r"^sharding.sequence: sequence degree 3 must "
                                          r"divide the attention heads 32"):
        family_named("hf").check_sequence_parallel(m.model, 3)


def test_tiles_are_refused_for_blocks_without_an_mlp(monkeypatch) -> None:
    cfg = config("checkpointing.tiles=2")
    deep_check(cfg)
    monkeypatch.setattr(type(family_named("llama")), "mlp_of", lambda self, block: None)
    with pytest.raises(ConfigError, match="^checkpointing.tiles: blocks layers.0, layers.1, "
                                          "layers.2 have no token-wise MLP"):
        deep_check(cfg)


def test_the_families_name_their_mlp() -> None:
    from trainer.build import build_on_meta, find_model_blocks

    for overrides, kind in ((["model=tiny"], "FeedForward"), (["model=hf", HF % 2], "LlamaMLP")):
        m = config(*overrides).model
        family = family_named(m.arch)
        _, blocks = find_model_blocks(build_on_meta(m), m)
        assert family.tileable and {type(family.mlp_of(b)).__name__ for b in blocks} == {kind}
    assert not family_named("vit").tileable


def test_the_plan_carries_tiles_to_the_table_and_plan_json(tmp_path) -> None:
    plan = with_tiles([BlockPlan(0, "layers.0"), BlockPlan(1, "layers.1", recompute="full")], 4)
    assert [p.tiles for p in plan] == [4, 4]
    assert "tiles" in plan_table(plan).splitlines()[0] and plan_table(plan).splitlines()[1].endswith("4")
    assert "tiles" not in plan_table(with_tiles(plan, 1))  # untiled plans print as before
    assert "tiles 4 x2" in describe(plan)
    assert [r["tiles"] for r in json.loads(plan_to_json(plan))] == [4, 4]
    with pytest.raises(ValueError, match="tiles must be an integer >= 1"):
        with_tiles(plan, 0)


def test_a_plan_file_keeps_its_own_tiles(tmp_path) -> None:
    from trainer.build import run_tiles
    from trainer.state.planfile import read_plan

    path = tmp_path / "plan.json"
    path.write_text(plan_to_json([BlockPlan(0, "a", tiles=3), BlockPlan(1, "b")]))
    plan = read_plan(str(path), ["a", "b"], True, False)
    assert [p.tiles for p in plan] == [3, 1]
    assert run_tiles(plan, config("checkpointing=file", f"checkpointing.plan_file={path}")
                     .checkpointing) == plan
    tiled = config("checkpointing.tiles=2").checkpointing
    assert [p.tiles for p in run_tiles(plan, tiled)] == [2, 2]  # a fixed policy: every block
    assert run_tiles(plan, tiled, decided=True) == plan  # the planner's own tiles stay
    auto = config("checkpointing.tiles=auto").checkpointing
    assert run_tiles(plan, auto, decided=True) == plan
    with pytest.raises(ConfigError, match="^checkpointing.tiles: auto is chosen by the planner"):
        run_tiles(plan, auto)
    path.write_text(json.dumps([{"index": 0, "name": "a", "tiles": 0}]))
    with pytest.raises(ConfigError, match=r"^checkpointing.plan_file: .*block a: tiles=0"):
        read_plan(str(path), ["a"], True, False)
    with pytest.raises(ConfigError, match="^checkpointing.tiles: checkpointing=file carries"):
        check(["checkpointing=file", f"checkpointing.plan_file={path}", "checkpointing.tiles=2"],
              {})


def test_a_sequence_group_slices_the_same_samples() -> None:
    whole = [tuple(torch.arange(24).view(2, 12) + k for k in range(3))]  # inputs, targets, positions
    pieces = [sampling(rank, 6, 2, 1, sequence=3).sliced(whole) for rank in range(6)]
    for rank, piece in enumerate(pieces):
        assert sampling(rank, 6, 2, 1, sequence=3).data_rank == rank // 3
        assert all(t.is_contiguous() and t.shape == (2, 4) for t in piece[0])
    for group in (0, 3):
        joined = [torch.cat([pieces[group + r][0][i] for r in range(3)], dim=1) for i in range(3)]
        assert all(torch.equal(a, b) for a, b in zip(joined, whole[0]))
    assert sampling(0, 6, 2, 3, sequence=3).global_batch_size == 12  # 2 groups x 2 x 3
    assert sampling(0, 6, 2, 1).sliced(whole) is whole


def test_a_stream_resumes_on_as_many_groups() -> None:
    from trainer.data.batches import StreamedData

    data = StreamedData.__new__(StreamedData)
    data.sampling = sampling(0, 2, 1, 1, sequence=2)  # 1 group of 2 ranks
    data.check_resume(1, 1)  # saved by 1 rank alone: one share of the records, as now
    data.check_resume(4, 1, 4)
    with pytest.raises(ConfigError, match=r"^data.streaming: .*saved by 2 ranks with a global "
                                          r"batch of 2.*now 2 ranks in groups of "
                                          r"sharding.sequence=2, 1"):
        data.check_resume(2, 2)
