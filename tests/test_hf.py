"""Hugging Face causal LMs (`model=hf`): built from a config offline, our blocks, plans and
sharding apply unchanged, and every policy keeps the gradients bit for bit."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from checkpointing.saved import SavedBytesMeter  # noqa: E402
from launch.env import init_distributed, read_env, shutdown  # noqa: E402
from offload.apply import close_offloader, offload_micro_batch  # noqa: E402
from tests.checkpoint_harness import batch  # noqa: E402
from tests.dist import spawn  # noqa: E402
from tests.helpers import config  # noqa: E402
from trainer.build import build_model  # noqa: E402
from trainer.config import ConfigError, validate  # noqa: E402
from trainer.model import lm_loss  # noqa: E402
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
    built = build_model(cfg, read_env("cpu"), replicate=1, meter=meter)
    optimizer = build_optimizer(built.model, cfg.optim)
    losses = []
    try:
        for step in range(steps):
            tokens = batch(step, rank)
            with offload_micro_batch(built.offloader), meter.measure():
                loss = lm_loss(built.model, tokens[:, :-1], tokens[:, 1:])
                loss.backward()
            grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                     .clone() for n, p in built.model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach().clone())
    finally:
        close_offloader(built.offloader)
    return torch.stack(losses), grads, [p.recompute for p in built.plan], meter.peak


def _all_policies(rank: int, world_size: int) -> dict:
    return {name: [_train_steps(arch, o, rank=rank) for o in POLICIES]
            for name, arch in (("llama", LLAMA), ("gpt2", GPT2))}


def _assert_bitwise(results: list) -> None:
    ref_losses, ref_grads, _, ref_peak = results[0]
    for (losses, grads, plan, peak), overrides in zip(results[1:], POLICIES[1:]):
        assert torch.equal(losses, ref_losses), overrides
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            assert torch.equal(grad, ref_grads[name]), (overrides, name)
        assert any(r != "none" for r in plan), overrides
        assert peak < ref_peak, overrides  # and it kept fewer activations


def test_hf_blocks_are_found_and_every_policy_is_bitwise_one_rank(monkeypatch) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    init_distributed(read_env("cpu"), timeout_s=60)
    try:
        results = _all_policies(0, 1)
    finally:
        shutdown()
    for name, per_policy in results.items():
        _assert_bitwise(per_policy)
        assert len(per_policy[1][2]) == 4, name  # the 4 decoder layers are the blocks


def test_hf_every_policy_is_bitwise_two_ranks_fsdp() -> None:
    for results in spawn(_all_policies, 2):
        for per_policy in results.values():
            _assert_bitwise(per_policy)


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
