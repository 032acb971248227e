"""The built-in Qwen3 (trainer/models/qwen3.py, model.arch=qwen3) and the built-in families'
export to transformers' format: the presets have the published shapes (the parameters of
transformers' own Qwen3 built from the exported config, one for one); the head norms act before
rotary and learn; an export of the built-in Llama and of Qwen3 loads in transformers'
LlamaForCausalLM / Qwen3ForCausalLM with nothing missing or left over and gives our logits
within 1e-5 (fp32); the report predicts a Qwen3 step's memory as it does a Llama's.

Elsewhere, Qwen3 is a parameter of the tests every built-in model passes: every policy bitwise
on 1 and 2 ranks (test_checkpointing.py), with every offload target (test_offload_trainer.py)
and compiled (test_compile.py), sequence parallel (test_sequence_models.py, and with tiles and
the chunked head through the trainer in test_sequence_runs.py), tiles (test_block_tiles.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers import config
from tests.test_report import POLICIES, TINY, _assert_close, _measured_step, _predicted
from trainer.build import build_on_meta, materialize
from trainer.models.families import family_named, family_of
from trainer.models.qwen3 import count_params

# Qwen3-8B's and Qwen3-32B's published config.json (hidden, intermediate, layers, heads, KV
# heads, head_dim, vocabulary, positions, rope_theta, rms_norm_eps, tied).
PUBLISHED = {"qwen3_8b": (4096, 12288, 36, 32, 8, 128, 151936, 40960, 1e6, 1e-6, False),
             "qwen3_32b": (5120, 25600, 64, 64, 8, 128, 151936, 40960, 1e6, 1e-6, False)}
FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
          "rope_theta", "rms_norm_eps", "tie_word_embeddings")


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_the_presets_have_the_published_shapes(preset: str) -> None:
    transformers = pytest.importorskip("transformers")
    m = config(f"model={preset}").model
    exported = family_of(m).hf_config(dataclasses.asdict(m))
    assert tuple(exported[f] for f in FIELDS) == PUBLISHED[preset]
    ours = build_on_meta(m)
    fields = {k: v for k, v in exported.items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        theirs = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**fields))
    shapes = {n: tuple(p.shape) for n, p in theirs.named_parameters()}
    assert sum(p.numel() for p in ours.parameters()) == sum(
        p.numel() for p in theirs.parameters()) == count_params(ours.args)
    # Queries wider than the model: 64 heads x 128 = 8192 on Qwen3-32B's 5120.
    q_rows = PUBLISHED[preset][3] * 128
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (q_rows, PUBLISHED[preset][0])
    assert tuple(ours.layers[0].attention.wq.weight.shape) == (q_rows, PUBLISHED[preset][0])
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (128,)


def _tiny(preset: str) -> tuple:
    cfg = config(f"model={preset}", "model.dropout=0.0")
    model = build_on_meta(cfg.model)
    materialize(model, torch.device("cpu"), seed=0)
    with torch.no_grad():  # norms away from 1, so a misplaced norm weight shows in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return cfg, model.eval()


def test_the_head_norms_act_before_rotary_and_learn() -> None:
    cfg, model = _tiny("qwen3_tiny")
    attention = model.layers[0].attention
    assert (attention.head_dim, attention.wq.out_features, cfg.model.dim) == (32, 128, 64)
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    before = model(tokens)
    with torch.no_grad():
        attention.q_norm.weight.mul_(3.0)
    assert not torch.allclose(model(tokens), before)  # the norm's weight reaches the logits
    model.train()
    model(tokens).sum().backward()
    assert attention.q_norm.weight.grad.abs().sum() > 0
    assert attention.k_norm.weight.grad.abs().sum() > 0
    assert model.output.weight is model.tok_embeddings.weight  # tied (qwen3_tiny's setting)


@pytest.mark.parametrize("preset, architecture", [("tiny", "LlamaForCausalLM"),
                                                  ("qwen3_tiny", "Qwen3ForCausalLM")])
def test_an_export_loads_in_transformers_with_our_logits(tmp_path, preset, architecture) -> None:
    transformers = pytest.importorskip("transformers")
    cfg, model = _tiny(preset)
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    family_of(cfg.model).export(tensors, dataclasses.asdict(cfg.model), str(tmp_path), 7,
                                str(tmp_path / "ckpt"))
    loaded, info = getattr(transformers, architecture).from_pretrained(
        tmp_path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert loaded.config.blocktrain["step"] == 7  # where it came from rides in config.json
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens), loaded.eval()(tokens).logits
    assert (ours - theirs).abs().max().item() < 1e-5


@pytest.mark.slow
def test_a_trained_qwen3_run_exports_a_folder_transformers_loads(tmp_path) -> None:
    """Through the trainer on 2 ranks (FSDP, full recompute, the chunked head) and
    `python -m trainer.export`: the checkpoint's tensors, tied embedding included, all land."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from tests.helpers import QUICK, REPO, check_ok, run_trainer
    from trainer.state.export import main as export_main

    run_dir, out = tmp_path / "run", tmp_path / "export"
    check_ok(run_trainer([*QUICK, "model=qwen3_tiny", "train.steps=2", "checkpointing=full",
                          "checkpointing.head=chunked", f"hydra.run.dir={run_dir}"], REPO,
                         nproc=2))
    assert export_main([str(run_dir), "--out", str(out)]) == 0
    loaded, info = transformers.Qwen3ForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    exported = load_file(out / "model.safetensors")
    assert "lm_head.weight" not in exported  # tied: the embedding is the head
    assert torch.equal(loaded.lm_head.weight, exported["model.embed_tokens.weight"])
    logits = loaded(torch.arange(16).unsqueeze(0)).logits
    assert logits.shape == (1, 16, 256) and torch.isfinite(logits).all()


def test_the_rotary_reordering_is_a_permutation_of_each_head() -> None:
    from trainer.models.families.llama import _halves

    rows = torch.arange(2 * 8).float().unsqueeze(1)  # 2 heads of 8: pairs (0,1) (2,3) ...
    assert _halves(rows, 8).squeeze(1).tolist() == [0, 2, 4, 6, 1, 3, 5, 7,
                                                    8, 10, 12, 14, 9, 11, 13, 15]
    assert family_named("qwen3").rotary_rows[-2:] == ("attention.q_norm.weight",
                                                      "attention.k_norm.weight")


@pytest.mark.parametrize("policy", [POLICIES[0], POLICIES[1], POLICIES[2]],
                         ids=["none", "full", "selective"])
def test_the_report_predicts_a_qwen3_step(world_of_one, policy) -> None:
    overrides = [*TINY, "model=qwen3_tiny", *policy]
    measured = _measured_step(overrides)
    predicted = _predicted(overrides, measured["plan"])
    _assert_close(predicted.end_of_forward, measured["act_saved_bytes"], 0.02,
                  f"qwen3 {policy[0]} activations")
    _assert_close(predicted.peak.total, measured["peak"], 0.03,
                  f"qwen3 {policy[0]} peak ({predicted.peak.name})")
