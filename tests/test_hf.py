"""Hugging Face causal LMs (`model=hf`): built from a config offline, our blocks, plans and
sharding apply unchanged, and every policy keeps the gradients bit for bit."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from checkpointing.meter import SavedBytesMeter  # noqa: E402
from trainer.distenv import init_distributed, read_env, shutdown  # noqa: E402
from tests.checkpoint_harness import assert_policies_bitwise, batch, train_steps  # noqa: E402
from tests.dist import spawn  # noqa: E402
from tests.helpers import config, layout_of  # noqa: E402
from trainer.build import build_model  # noqa: E402
from trainer.config import ConfigError  # noqa: E402
from trainer.validate import validate  # noqa: E402
from trainer.models.llama import lm_loss  # noqa: E402
from trainer.optim import build_optimizer  # noqa: E402

# Tiny configs of two architectures, dropout on (attention and residual), byte vocabulary.
LLAMA = ("model.hf_config={model_type: llama, vocab_size: 256, hidden_size: 64, "
         "intermediate_size: 128, num_hidden_layers: 4, num_attention_heads: 4, "
         "num_key_value_heads: 2, max_position_embeddings: 128, attention_dropout: 0.1}")
GPT2 = ("model.hf_config={model_type: gpt2, vocab_size: 256, n_embd: 64, n_layer: 4, n_head: 4, "
        "n_positions: 128, resid_pdrop: 0.1, embd_pdrop: 0.1, attn_pdrop: 0.1}")
SMALL = ["model=hf", "data.seq_len=64", "train.micro_batch_size=4",
         "checkpointing.profile_repeats=1"]
POLICIES = [["checkpointing=none"], ["checkpointing=full"], ["checkpointing=every_k"],
            ["checkpointing=selective"], ["checkpointing=budget", "checkpointing.budget=0.45"],
            ["checkpointing=full", "offload=disk", "offload.min_bytes=0"]]


def _train_steps(arch: str, overrides: list[str], steps: int = 3, rank: int = 0):
    cfg = config(*SMALL, arch, *overrides)
    meter = SavedBytesMeter()
    torch.manual_seed(7 + rank)  # dropout masks: the same sequence for every policy
    built = build_model(cfg, read_env("cpu"), layout=layout_of(cfg), meter=meter)
    losses, grads, _ = train_steps(built, meter, cfg.optim, steps, rank)
    return losses, grads, [p.recompute for p in built.plan], meter.peak


def _all_policies(rank: int, world_size: int) -> dict:
    return {name: [_train_steps(arch, o, rank=rank) for o in POLICIES]
            for name, arch in (("llama", LLAMA), ("gpt2", GPT2))}


def test_hf_blocks_are_found_and_every_policy_is_bitwise_one_rank(monkeypatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    init_distributed(read_env("cpu"), timeout_s=60)
    try:
        results = _all_policies(0, 1)
    finally:
        shutdown()
    for name, per_policy in results.items():
        assert_policies_bitwise(per_policy, POLICIES)
        assert len(per_policy[1][2]) == 4, name  # the 4 decoder layers are the blocks


def test_hf_every_policy_is_bitwise_two_ranks_fsdp() -> None:
    for results in spawn(_all_policies, 2):
        for per_policy in results.values():
            assert_policies_bitwise(per_policy, POLICIES)


@pytest.mark.parametrize("overrides,message", [
    (["model=hf"], "model.path: model.arch=hf needs exactly one of model.path=<local folder> or "
                   "model.hf_config={model_type: ..., ...}"),
    (["model=hf", "model.path=/nonexistent"], "model.path: /nonexistent has no config.json (a "
                                              "folder written by save_pretrained; nothing is "
                                              "downloaded)"),
    (["model=hf", "model.hf_config={hidden_size: 64}"],
     "model.hf_config: must be a mapping with model_type, e.g. {model_type: llama, hidden_size: "
     "128, num_hidden_layers: 2}"),
    (["model=hf", LLAMA, "model.dropout=0.1"],
     "model.dropout: unused with model.arch=hf; set the HF config's own dropout fields instead"),
])
def test_bad_hf_settings_name_the_key(overrides, message) -> None:
    with pytest.raises(ConfigError) as caught:
        validate(config(*overrides), world_size=1, num_nodes=1)
    assert str(caught.value) == message


def _tiny_llama_folder(folder) -> "torch.nn.Module":
    """A tiny Llama saved as Hugging Face saves models (the pretrained-path input)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model("llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(3)
    reference = AutoModelForCausalLM.from_config(hf_cfg).eval()
    reference.save_pretrained(folder)
    return reference


def _logits_of_loaded(rank: int, world_size: int, folder: str, tokens: torch.Tensor):
    cfg = config("model=hf", f"model.path={folder}", "data.seq_len=64",
                 "train.micro_batch_size=4", "checkpointing=full")
    built = build_model(cfg, read_env("cpu"), layout=layout_of(cfg), meter=SavedBytesMeter())
    built.model.eval()
    with torch.no_grad():
        return built.model(tokens)


def test_pretrained_folder_loads_into_sharded_ranks_with_the_same_logits(tmp_path) -> None:
    reference = _tiny_llama_folder(tmp_path / "tiny")
    tokens = batch(0)[:, :-1]
    with torch.no_grad():
        expected = reference(input_ids=tokens).logits
    for logits in spawn(_logits_of_loaded, 2, str(tmp_path / "tiny"), tokens):
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)


def test_trained_checkpoint_exports_to_a_folder_hugging_face_loads(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from tests.helpers import QUICK, REPO, check_ok, run_trainer
    from trainer.state.export import main as export_main

    run_dir, out = tmp_path / "run", tmp_path / "export"
    check_ok(run_trainer([*QUICK, "model=hf", LLAMA, "train.steps=3", "checkpointing=selective",
                          f"hydra.run.dir={run_dir}"], REPO, nproc=2))
    assert export_main([str(run_dir), "--out", str(out)]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tokens = batch(1)[:, :-1]
    with torch.no_grad():
        expected = loaded(input_ids=tokens).logits
    # Our model, loading the exported folder the way it loads any pretrained one.
    logits = spawn(_logits_of_loaded, 1, str(out), tokens)[0]
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(expected, _random_init_logits(tokens))  # it is the trained model


def _random_init_logits(tokens: torch.Tensor) -> torch.Tensor:
    from trainer.models.hf import build_hf_on_meta

    cfg = config("model=hf", LLAMA).model
    model = build_hf_on_meta(cfg.hf_config, None)
    model.to_empty(device="cpu")
    for name, param in model.named_parameters():
        model.init_param(name, param.data, torch.Generator().manual_seed(0))
    model.reset_buffers()
    with torch.no_grad():
        return model.eval()(tokens)


def _frozen_fine_tune(rank: int, world_size: int):
    cfg = config(*SMALL, LLAMA, "checkpointing=full",
                 "model.freeze=[hf.model.embed_tokens.*,hf.model.layers.0.*]")
    built = build_model(cfg, read_env("cpu"), layout=layout_of(cfg), meter=SavedBytesMeter())
    before = {n: p.full_tensor().clone() for n, p in built.model.named_parameters()}
    optimizer = build_optimizer(built.model, cfg.optim)
    for step in range(2):
        tokens = batch(step, rank)
        lm_loss(built.model, tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
    after = {n: p.full_tensor() for n, p in built.model.named_parameters()}
    flags = {n: p.requires_grad for n, p in built.model.named_parameters()}
    return before, after, flags, len(optimizer.state)


def test_frozen_subset_stays_unchanged_with_checkpointing_on() -> None:
    for before, after, flags, with_state in spawn(_frozen_fine_tune, 2):
        frozen = [n for n, trainable in flags.items() if not trainable]
        assert frozen and all(".embed_tokens." in n or ".layers.0." in n for n in frozen)
        assert len(frozen) == 1 + 9  # embeddings + layer 0's 7 matrices and 2 norms
        for name in before:
            changed = not torch.equal(before[name], after[name])
            assert changed == flags[name], name
        assert with_state == len(flags) - len(frozen)  # no optimizer state for frozen ones


def test_freeze_pattern_that_matches_nothing_names_the_setting() -> None:
    cfg = config(*SMALL, LLAMA, "model.freeze=[model.layers.*]")
    with pytest.raises(ConfigError, match=r"model.freeze: 'model.layers.\*' matches no "
                                          r"parameter; names look like hf.model.embed_tokens"):
        build_model(cfg, read_env("cpu"), layout=layout_of(cfg), meter=SavedBytesMeter())


def test_attn_implementation_reaches_the_hf_model() -> None:
    """model.attn_implementation was once passed into an unused argument: HF ran sdpa always."""
    from trainer.build import build_on_meta

    for choice in ("eager", "sdpa"):
        cfg = config("model=hf", "model.hf_config={model_type: llama, num_hidden_layers: 1}",
                     f"model.attn_implementation={choice}")
        assert build_on_meta(cfg.model).hf.config._attn_implementation == choice


@pytest.mark.parametrize("damage", ["truncated", "empty", "a shard missing"])
def test_damaged_pretrained_weights_are_named_in_one_line(tmp_path, damage) -> None:
    """Issue 27 item 7: a cut or empty model.safetensors, or a shard the index lists but the
    folder lacks, is one line naming the file (not safetensors' traceback, nor "no tensor")."""
    import json

    from tests.helpers import QUICK, run_trainer

    folder = tmp_path / "tiny"
    reference = _tiny_llama_folder(folder)
    weights = folder / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:-1000])
        expected = f"error: model.path: {weights} is not a complete safetensors file ("
    elif damage == "empty":
        weights.write_bytes(b"")
        expected = f"error: model.path: {weights} is not a complete safetensors file ("
    else:  # what save_pretrained writes for a large model, one shard short
        reference.save_pretrained(folder, max_shard_size="100KB")
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        shard = sorted(set(index["weight_map"].values()))[-1]
        (folder / shard).unlink()
        expected = f"error: model.path: {folder / shard} is missing"
    result = run_trainer([*QUICK, "model=hf", f"model.path={folder}", "data=synthetic",
                          "train.steps=1", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert lines[-1].startswith(expected), result.stderr[-3000:]
