"""Hugging Face image classifiers (`model=hf_vision`): the same plan applies (every policy
bitwise, 1 and 2 ranks), and a saved "pretrained" folder fine-tunes at a higher resolution."""

from __future__ import annotations

import json

import pytest
import torch

from tests.checkpoint_harness import assert_policies_bitwise
from tests.dist import spawn
from tests.helpers import QUICK, check_ok, config, read_metrics, run_trainer
from tests.test_vit import POLICIES, _run

VIT = ("{model_type: vit, hidden_size: 32, num_hidden_layers: 4, num_attention_heads: 2, "
       "intermediate_size: 64, patch_size: 8, attention_probs_dropout_prob: 0.1}")
# 32x32 images in 8x8 patches (16 tokens + the class token), HF ViT's dropouts on (hidden from
# model.dropout, attention probabilities from the HF config).
SMALL = ["model=hf_vision", f"model.hf_config={VIT}", "model.image_size=32",
         "model.patch_size=8", "model.num_classes=10", "model.dropout=0.1",
         "train.micro_batch_size=4", "checkpointing.profile_repeats=1"]


def _all_policies(rank: int, world_size: int) -> list:
    return [_run(SMALL + o, steps=3, rank=rank) for o in POLICIES]


def test_hf_vit_blocks_are_found_and_every_policy_is_bitwise_one_rank(world_of_one) -> None:
    results = _all_policies(0, 1)
    assert_policies_bitwise(results, POLICIES)
    assert len(results[1][2]) == 4  # the 4 encoder layers, found as the repeated blocks


@pytest.mark.slow
def test_hf_vit_every_policy_is_bitwise_two_ranks_fsdp() -> None:
    for results in spawn(_all_policies, 2):
        assert_policies_bitwise(results, POLICIES)


def _pretrained_folder(tmp_path, image_size: int, num_classes: int):
    """A "pretrained" HF ViT saved at 64 px: what save_pretrained writes, no download."""
    from transformers import ViTConfig, ViTForImageClassification

    hf = ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                   intermediate_size=64, patch_size=16, image_size=image_size,
                   num_labels=num_classes)
    torch.manual_seed(0)
    model = ViTForImageClassification(hf)
    model.save_pretrained(tmp_path / "pretrained")
    return tmp_path / "pretrained", model


@pytest.mark.slow
def test_fine_tuning_a_saved_model_at_a_higher_resolution(tmp_path) -> None:
    folder, pretrained = _pretrained_folder(tmp_path, image_size=64, num_classes=1000)
    run_dir = tmp_path / "run"
    result = run_trainer(QUICK + [
        "model=hf_vision", f"model.path={folder}", "model.image_size=128", "model.num_classes=4",
        "train.micro_batch_size=8", "train.steps=40", "train.eval_every=40",
        "train.eval_batches=4", "optim.lr=1e-3", "checkpointing=full", "logging.every=10",
        "model.freeze=[hf.vit.layers.0.layernorm_before.*]", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, timeout=600)
    check_ok(result)
    assert "the pretrained classifier.weight has shape (1000, 32)" in (
        run_dir / "train.log").read_text()
    # Every weight but the positions and the head loaded unchanged; the positions were resized
    # from the 4x4 grid to 8x8; the run learned (4 classes: chance is 0.25).
    from trainer.state.export import export

    out = export(str(run_dir / "checkpoints" / "step_00000040"), str(tmp_path / "export"))
    from transformers import ViTForImageClassification

    tuned = ViTForImageClassification.from_pretrained(out, local_files_only=True)
    assert tuned.config.image_size == 128 and tuned.config.num_labels == 4
    assert tuned.vit.embeddings.position_embeddings.shape == (1, 65, 32)
    frozen = tuned.vit.layers[0].layernorm_before.weight  # model.freeze held it
    assert torch.equal(frozen, pretrained.vit.layers[0].layernorm_before.weight)
    assert not torch.equal(tuned.vit.layers[0].attention.q_proj.weight,
                           pretrained.vit.layers[0].attention.q_proj.weight)
    val = [m["val_accuracy"] for m in read_metrics(run_dir) if "val_accuracy" in m]
    assert val[-1] > 0.5, val

    # At step 0 (before any update) the weights are the saved ones: build and compare.
    cfg = config("model=hf_vision", f"model.path={folder}", "model.image_size=128",
                 "model.num_classes=4", "sharding=none")
    from trainer.build import build_on_meta, materialize

    model = build_on_meta(cfg.model)
    materialize(model, torch.device("cpu"), cfg.train.seed)
    saved = dict(pretrained.named_parameters())
    for name, param in model.named_parameters():
        hf_name = name[len("hf."):]
        if "position_embeddings" in hf_name or hf_name.startswith("classifier."):
            continue
        assert torch.equal(param, saved[hf_name]), hf_name
    assert json.loads((tmp_path / "export" / "config.json").read_text())["model_type"] == "vit"


@pytest.mark.slow
def test_report_predicts_a_1024px_hf_vit_step_under_full(tmp_path) -> None:
    """The pre-flight report's memory model (run for the dashboard: memory_plan.json) against
    the live tensor bytes of a measured CPU step, HF ViT at 1024 x 1024 (4096 patch tokens)."""
    run_dir = tmp_path / "run"
    wide = ("{model_type: vit, hidden_size: 64, num_hidden_layers: 4, num_attention_heads: 2, "
            "intermediate_size: 256, patch_size: 16}")
    check_ok(run_trainer(QUICK + [
        "model=hf_vision", f"model.hf_config={wide}", "model.image_size=1024",
        "model.patch_size=16", "model.dropout=0.1", "train.micro_batch_size=1",
        "train.steps=2", "checkpointing=full", "logging.wandb=true", "logging.live_bytes_step=2",
        "sharding=none", "checkpointing.profile_repeats=1", f"hydra.run.dir={run_dir}"],
        cwd=tmp_path,
        env={"WANDB_MODE": "offline"}, timeout=600))
    predicted = json.loads((run_dir / "memory_plan.json").read_text())
    [live] = [m["live_peak_bytes"] for m in read_metrics(run_dir) if "live_peak_bytes" in m]
    peak = predicted["per_rank_bytes"]["predicted_peak"]
    print(f"HF ViT 1024px full: predicted {peak / 2**20:.1f} MiB, measured {live / 2**20:.1f} MiB")
    assert live == pytest.approx(peak, rel=0.02)


def one_image_per_class(tmp_path):
    """The same random 32 px image under classes a and b of train/ and val/: (pixels, data)."""
    import numpy as np
    from PIL import Image

    from trainer.config import DataConfig

    pixels = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    for split in ("train", "val"):
        for label in ("a", "b"):
            (tmp_path / split / label).mkdir(parents=True)
            Image.fromarray(pixels).save(tmp_path / split / label / "0.png")
    return pixels, DataConfig(source="images", train_path=str(tmp_path / "train"),
                              val_path=str(tmp_path / "val"))


def test_images_follow_the_pretrained_models_preprocessing(tmp_path) -> None:
    """A folder with preprocessor_config.json (mean/std 0.5, bilinear) sets how images are
    scaled for model=hf_vision; without one, ImageNet statistics and bicubic."""
    import numpy as np
    from PIL import Image
    from transformers import ViTImageProcessor

    from trainer.config import DataConfig
    from tests.helpers import sampling
    from trainer.data.factory import source_of
    from trainer.models.families import family_of
    from trainer.validate import model_facts

    folder, _ = _pretrained_folder(tmp_path, image_size=32, num_classes=2)
    ViTImageProcessor(image_mean=[0.5] * 3, image_std=[0.5] * 3,
                      resample=2).save_pretrained(folder)
    pixels, data = one_image_per_class(tmp_path)
    expected = (pixels.astype(np.float32) / 255.0 - 0.5) / 0.5  # 32 px: no resize
    for path, mean in ((str(folder), 0.5), (None, None)):
        model = config("model=hf_vision", "model.image_size=32", "model.num_classes=2",
                       f"model.path={path}" if path else f"model.hf_config={VIT}").model
        train, _ = source_of(data).datasets(data, model_facts(model), sampling(0, 1, 1, 1),
                                            family_of(model).image_preprocessing(model))
        image, _ = train[0]
        if mean is not None:
            assert train.resample == 2
            assert torch.allclose(image, torch.from_numpy(expected.transpose(2, 0, 1)))
        else:
            assert train.resample == 3 and train.mean.tolist() == pytest.approx([0.485, 0.456,
                                                                                  0.406])
