"""The ViT image classifier (`model=vit_*`): every policy keeps gradients bit for bit, and at a
high resolution full checkpointing keeps only each block's input."""

from __future__ import annotations

import pytest
import torch

from checkpointing.meter import SavedBytesMeter
from trainer.distenv import read_env
from tests.checkpoint_harness import assert_policies_bitwise, train_steps
from tests.dist import spawn
from tests.helpers import config, layout_of
from trainer.build import build_model
from trainer.models.vit import classification_loss

# 32x32 images in 8x8 patches (16 tokens + the class token), dropout on.
SMALL = ["model=vit_tiny", "model.image_size=32", "model.patch_size=8", "model.dim=32",
         "model.n_heads=2", "model.ffn_hidden=64", "model.n_layers=4", "model.dropout=0.1",
         "train.micro_batch_size=4", "checkpointing.profile_repeats=1"]
POLICIES = [["checkpointing=none"], ["checkpointing=full"], ["checkpointing=every_k"],
            ["checkpointing=selective"], ["checkpointing=budget", "checkpointing.budget=0.45"],
            ["checkpointing=full", "offload=disk", "offload.min_bytes=0"]]


def image_batch(cfg, step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    m = cfg.model
    images = torch.randn(cfg.train.micro_batch_size, m.channels, m.image_size, m.image_size,
                         generator=g)
    return images, torch.randint(0, m.num_classes, (cfg.train.micro_batch_size,), generator=g)


def _run(overrides: list[str], steps: int, rank: int):
    cfg = config(*overrides)
    meter = SavedBytesMeter()
    torch.manual_seed(7 + rank)  # dropout masks: the same sequence for every policy
    built = build_model(cfg, read_env("cpu"), layout=layout_of(cfg), meter=meter)
    losses, grads, _ = train_steps(built, meter, cfg.optim, steps, rank,
                                   make_batch=lambda s, r: image_batch(cfg, s, r),
                                   loss_fn=classification_loss)
    return losses, grads, [p.recompute for p in built.plan], meter.peak


def _all_policies(rank: int, world_size: int) -> list:
    return [_run(SMALL + o, steps=3, rank=rank) for o in POLICIES]


def test_vit_blocks_are_found_and_every_policy_is_bitwise_one_rank(world_of_one) -> None:
    results = _all_policies(0, 1)
    assert_policies_bitwise(results, POLICIES)
    assert len(results[1][2]) == 4  # the 4 encoder blocks


def test_vit_every_policy_is_bitwise_two_ranks_fsdp() -> None:
    for results in spawn(_all_policies, 2):
        assert_policies_bitwise(results, POLICIES)


# 1024x1024 RGB in 16x16 patches: 4096 patch tokens + the class token per image.
HIGH_RES = ["model=vit_tiny", "model.image_size=1024", "model.dim=64", "model.n_heads=2",
            "model.ffn_hidden=256", "model.n_layers=4", "model.dropout=0.1",
            "train.micro_batch_size=1", "sharding=none", "checkpointing.profile_repeats=1"]


def test_full_checkpointing_at_1024px_keeps_only_block_inputs_with_identical_gradients(
        world_of_one) -> None:
    from trainer.preflight.scenario import Evaluator, Scenario
    from trainer.cli import check

    runs = {p: _run(HIGH_RES + [f"checkpointing={p}"], steps=1, rank=0) for p in ("none", "full")}
    (loss, grads, _, none_bytes), (full_loss, full_grads, _, full_bytes) = runs["none"], runs["full"]
    assert torch.equal(loss, full_loss)
    assert all(torch.equal(full_grads[n], g) for n, g in grads.items())

    tokens, dim, layers = 4097, 64, 4
    block_input = tokens * dim * 4  # fp32 [1, 4097, 64]: all a fully recomputed block keeps
    image = 3 * 1024 * 1024 * 4  # kept for the patch projection's weight gradient
    outside_blocks = full_bytes - layers * block_input - image
    # Around the blocks only the embedding sum and the head's few tensors remain.
    assert 0 <= outside_blocks <= 3 * block_input, outside_blocks
    # The factor the pre-flight report expects from its meta trace (no real tensors), measured.
    predicted = {}
    for policy in ("none", "full"):
        cfg, layout = check(HIGH_RES + [f"checkpointing={policy}"], {"WORLD_SIZE": "1"})
        predicted[policy] = Evaluator(tflops=400).evaluate(Scenario(cfg, layout, 1))
    expected = predicted["none"].estimate.end_of_forward / predicted["full"].estimate.end_of_forward
    measured = none_bytes / full_bytes
    print(f"1024px ViT activations: none {none_bytes / 2**20:.1f} MiB, full "
          f"{full_bytes / 2**20:.1f} MiB: {measured:.2f}x (report expects {expected:.2f}x)")
    assert measured == pytest.approx(expected, rel=0.02)
    assert measured > 4


# --- the trainer, end to end ------------------------------------------------------------------

CLI = ["model=vit_tiny", "model.image_size=32", "model.patch_size=8", "model.dim=32",
       "model.n_heads=2", "model.ffn_hidden=64", "model.n_layers=2", "train.steps=30",
       "train.micro_batch_size=8", "train.eval_every=15", "train.eval_batches=4",
       "logging.every=1", "logging.wandb=false", "logging.progress=false",
       "optim.warmup_steps=2", "model.dropout=0.1"]


@pytest.mark.slow
def test_synthetic_images_train_to_accuracy_sharded_as_in_one_process(tmp_path) -> None:
    from tests.helpers import REPO, check_ok, read_metrics, step_losses, run_trainer

    runs = {}
    for nproc, policy in ((1, "none"), (2, "full")):
        run_dir = tmp_path / f"{nproc}-{policy}"
        # The same global batch of 16 images: 2 micro-batches of 8 in one process, or 8 per
        # rank; dropout off, so the two runs must compute the same losses.
        check_ok(run_trainer([*CLI, f"checkpointing={policy}", f"hydra.run.dir={run_dir}",
                              "train.global_batch_size=16", "model.dropout=0",
                              "train.eval_at_start=true"], REPO,
                             nproc=nproc))
        runs[nproc] = run_dir
    one, two = step_losses(runs[1]), step_losses(runs[2])
    assert one.keys() == two.keys() == set(range(1, 31))
    assert list(two.values()) == pytest.approx(list(one.values()), rel=1e-4)
    evals = [m for m in read_metrics(runs[2]) if "val_accuracy" in m]
    assert [m["step"] for m in evals] == [0, 15, 30]
    # 10 classes: chance is 0.1; the labels are learnable, so accuracy must climb well above it.
    assert evals[0]["val_accuracy"] < 0.3 and evals[-1]["val_accuracy"] >= 0.6
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    logged = [m for m in read_metrics(runs[2]) if "loss" in m]
    # Throughput counts patch tokens (4 x 4 patches of 8 pixels per image) and images.
    assert all(m["tokens_per_s"] == pytest.approx(16 * m["samples_per_s"]) for m in logged)


def _image_folder(root, sizes=((48, 40), (40, 64), (33, 33))):
    """Two classes told apart by colour, at sizes that need resizing and cropping."""
    from PIL import Image

    rng = torch.Generator().manual_seed(0)
    for split, count in (("train", 6), ("val", 2)):
        for name, colour in (("blue", (20, 40, 220)), ("red", (220, 30, 30))):
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                width, height = sizes[i % len(sizes)]
                noise = torch.randint(-20, 21, (height, width, 3), generator=rng)
                pixels = (torch.tensor(colour) + noise).clamp(0, 255).to(torch.uint8)
                Image.fromarray(pixels.numpy()).save(root / split / name / f"{i}.png")


def test_image_folder_labels_by_sorted_class_and_crops_to_size(tmp_path) -> None:
    from trainer.data.images import MEAN, STD, ImageFolder

    _image_folder(tmp_path)
    train = ImageFolder(str(tmp_path / "train"), 32, 3, "data.train_path")
    assert train.classes == ["blue", "red"] and len(train) == 12
    image, label = train[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and label == 0
    # A red image, normalised by the ImageNet statistics: red channel high, blue low.
    image, label = train[6]
    assert label == 1
    red = (220 / 255 - MEAN[0]) / STD[0]
    assert abs(image[0].mean().item() - red) < 0.1 and image[2].mean() < 0
    val = ImageFolder(str(tmp_path / "val"), 32, 3, "data.val_path", classes=train.classes)
    assert [lbl for _, lbl in val.files] == [0, 0, 1, 1]


def test_augmented_samples_vary_by_draw_and_repeat_for_the_same_draw(tmp_path) -> None:
    from trainer.data.tokens import train_batch
    from trainer.data.images import ImageFolder

    _image_folder(tmp_path)
    plain = ImageFolder(str(tmp_path / "train"), 32, 3, "data.train_path")
    augmented = ImageFolder(str(tmp_path / "train"), 32, 3, "data.train_path", augment=True,
                            seed=5)
    first, label = augmented.sample(6, draw=100)
    assert first.shape == (3, 32, 32) and label == 1
    assert torch.equal(first, augmented.sample(6, draw=100)[0])  # a resume sees the same
    crops = [augmented.sample(6, draw=d)[0] for d in range(101, 105)]
    assert all(not torch.equal(first, crop) for crop in crops)  # another epoch, another crop
    assert torch.equal(plain.sample(6, draw=100)[0], plain[6][0])  # off: the centre crop
    # The sampler hands each sample its global position: step 4's samples are 16-19 (of
    # epoch 1, with 12 images), at this rank's windows of that epoch's permutation.
    images, labels = train_batch(augmented, 4, 4, 1, 0, 1, seed=0)[0]
    centre = [plain[i] for i in range(12)]
    for image, label, draw in zip(images, labels, range(16, 20)):
        window = next(i for i in range(12) if centre[i][1] == label and torch.equal(
            image, augmented.sample(i, draw)[0]))
        assert not torch.equal(image, centre[window][0])


def test_grey_images_have_one_channel(tmp_path) -> None:
    from trainer.data.images import ImageFolder

    _image_folder(tmp_path)
    image, _ = ImageFolder(str(tmp_path / "val"), 16, 1, "data.val_path")[0]
    assert image.shape == (1, 16, 16)


@pytest.mark.slow
def test_image_folder_run_reports_accuracy(tmp_path) -> None:
    from tests.helpers import REPO, check_ok, read_metrics, run_trainer

    _image_folder(tmp_path / "data")
    run_dir = tmp_path / "run"
    check_ok(run_trainer([*CLI, "data=images", f"data.train_path={tmp_path / 'data/train'}",
                          f"data.val_path={tmp_path / 'data/val'}", "model.num_classes=2",
                          "train.steps=15", "train.micro_batch_size=4", "train.eval_batches=1",
                          "checkpointing=selective", "train.eval_at_start=true",
                          f"hydra.run.dir={run_dir}"], REPO))
    evals = [m for m in read_metrics(run_dir) if "val_accuracy" in m]
    assert [m["step"] for m in evals] == [0, 15]
    assert evals[-1]["val_accuracy"] == 1.0  # red against blue


def test_image_folder_with_other_class_count_names_num_classes(tmp_path) -> None:
    from trainer.config import ConfigError
    from trainer.validate import validate

    _image_folder(tmp_path)
    cfg = config("model=vit_tiny", "data=images", f"data.train_path={tmp_path / 'train'}",
                 f"data.val_path={tmp_path / 'val'}")
    with pytest.raises(ConfigError, match=r"^model.num_classes: 10, but .* has 2 class folders; "
                                          r"set model.num_classes=2$"):
        validate(cfg, world_size=1)
    (tmp_path / "val" / "green").mkdir()
    cfg = config("model=vit_tiny", "data=images", f"data.train_path={tmp_path / 'train'}",
                 f"data.val_path={tmp_path / 'val'}", "model.num_classes=2")
    with pytest.raises(ConfigError, match=r"^data.val_path: class folders \['green'\] are not"):
        validate(cfg, world_size=1)


def test_synthetic_images_depend_only_on_seed_stream_and_index() -> None:
    from trainer.data.images import SyntheticImages

    a = SyntheticImages(10, 48, 3, 100, seed=1, stream=0)
    b = SyntheticImages(10, 48, 3, 100, seed=1, stream=0)
    val = SyntheticImages(10, 48, 3, 100, seed=1, stream=1)
    assert torch.equal(a[7][0], b[7][0]) and a[7][1] == b[7][1]
    assert not torch.equal(a[7][0], val[7][0])
    assert a[7][0].shape == (3, 48, 48)
    assert len({a[i][1] for i in range(100)}) == 10  # every class appears


# --- fine-tuning from an exported ViT ---------------------------------------------------------

def _loaded_params(rank: int, world_size: int, overrides: list[str]) -> dict:
    from checkpointing.blocks import canonical_name

    built = build_model(config(*overrides), read_env("cpu"), layout_of(config(*overrides)),
                        meter=SavedBytesMeter())
    return {canonical_name(n): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
            for n, p in built.model.named_parameters()}


@pytest.mark.slow
def test_exported_vit_fine_tunes_at_a_higher_resolution_with_a_new_head(tmp_path) -> None:
    from safetensors.torch import load_file

    from tests.helpers import REPO, check_ok, run_trainer
    from trainer.config import ConfigError
    from trainer.state.export import main as export_main
    from trainer.validate import validate
    from trainer.models.vit import resize_positions

    run_dir, out = tmp_path / "run", tmp_path / "export"
    check_ok(run_trainer([*CLI, "train.steps=3", f"hydra.run.dir={run_dir}"], REPO))
    assert export_main([str(run_dir), "--out", str(out)]) == 0
    exported = load_file(out / "model.safetensors")
    pretrained = [*CLI, f"model.path={out}", "checkpointing=full"]
    # The same shape on two sharded ranks: every parameter as exported.
    for params in spawn(_loaded_params, 2, pretrained):
        assert params.keys() == exported.keys()
        assert all(torch.equal(params[n], t) for n, t in exported.items())
    # 64x64 images (8 x 8 patches instead of 4 x 4) and 3 classes instead of 10.
    params = spawn(_loaded_params, 1, [*pretrained, "model.image_size=64",
                                       "model.num_classes=3"])[0]
    assert torch.equal(params["pos_embed"], resize_positions(exported["pos_embed"], 8))
    assert params["pos_embed"].shape == (1, 65, 32)
    assert params["head.weight"].shape == (3, 32) and not params["head.bias"].any()
    kept = [n for n in exported if n not in ("pos_embed", "head.weight", "head.bias")]
    assert all(torch.equal(params[n], exported[n]) for n in kept)
    with pytest.raises(ConfigError, match=r"^model.dim: 64, but the pretrained model in .* has "
                                          r"32; set model.dim=32$"):
        validate(config(*pretrained, "model.dim=64"), world_size=1)


def test_resized_positions_keep_the_class_token_and_a_constant_grid() -> None:
    from trainer.models.vit import resize_positions

    saved = torch.cat([torch.full((1, 1, 4), 7.0), torch.full((1, 16, 4), 2.0)], dim=1)
    resized = resize_positions(saved, 8)
    assert resized.shape == (1, 65, 4)
    assert torch.equal(resized[:, 0], saved[:, 0])
    torch.testing.assert_close(resized[:, 1:], torch.full((1, 64, 4), 2.0))
