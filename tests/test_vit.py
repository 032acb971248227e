"""The ViT image classifier (`model=vit_*`): every policy keeps gradients bit for bit, and at a
high resolution full checkpointing keeps only each block's input."""

from __future__ import annotations

import pytest
import torch

from checkpointing.saved import SavedBytesMeter
from launch.env import init_distributed, read_env, shutdown
from tests.checkpoint_harness import train_steps
from tests.dist import spawn
from tests.helpers import config
from trainer.build import build_model
from trainer.vit import classification_loss

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
    built = build_model(cfg, read_env("cpu"), replicate=1, meter=meter)
    losses, grads, _ = train_steps(built, meter, cfg.optim, steps, rank,
                                   make_batch=lambda s, r: image_batch(cfg, s, r),
                                   loss_fn=classification_loss)
    return losses, grads, [p.recompute for p in built.plan], meter.peak


def _all_policies(rank: int, world_size: int) -> list:
    return [_run(SMALL + o, steps=3, rank=rank) for o in POLICIES]


def _assert_bitwise(results: list) -> None:
    ref_losses, ref_grads, _, ref_peak = results[0]
    for (losses, grads, plan, peak), overrides in zip(results[1:], POLICIES[1:]):
        assert torch.equal(losses, ref_losses), overrides
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            assert torch.equal(grad, ref_grads[name]), (overrides, name)
        assert any(r != "none" for r in plan), overrides
        assert peak < ref_peak, overrides


@pytest.fixture
def world_of_one(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    init_distributed(read_env("cpu"), timeout_s=60)
    yield
    shutdown()


def test_vit_blocks_are_found_and_every_policy_is_bitwise_one_rank(world_of_one) -> None:
    results = _all_policies(0, 1)
    _assert_bitwise(results)
    assert len(results[1][2]) == 4  # the 4 encoder blocks


def test_vit_every_policy_is_bitwise_two_ranks_fsdp() -> None:
    for results in spawn(_all_policies, 2):
        _assert_bitwise(results)


# 1024x1024 RGB in 16x16 patches: 4096 patch tokens + the class token per image.
HIGH_RES = ["model=vit_tiny", "model.image_size=1024", "model.dim=64", "model.n_heads=2",
            "model.ffn_hidden=256", "model.n_layers=4", "model.dropout=0.1",
            "train.micro_batch_size=1", "sharding=none", "checkpointing.profile_repeats=1"]


def test_full_checkpointing_at_1024px_keeps_only_block_inputs_with_identical_gradients(
        world_of_one) -> None:
    from checkpointing.scenario import Evaluator, Scenario
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
