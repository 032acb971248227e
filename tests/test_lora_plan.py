"""The memory model under LoRA (checkpointing/planner/param_bytes.py): the frozen base has no
gradients nor optimizer state and is stored as it is (bf16 under mixed precision, NF4's
half-byte codes under QLoRA); the adapters train in fp32."""

from __future__ import annotations

import math

import pytest

from checkpointing.planner.memory import param_groups
from tests.helpers import config
from trainer.build import build_run_model, find_model_blocks

TINY = ["model=tiny", "model.dim=64", "model.n_layers=2", "model.ffn_hidden=128",
        "sharding.param_dtype=bfloat16", "model.lora.rank=8"]


def _groups(*overrides):
    cfg = config(*TINY, *overrides)
    model = build_run_model(cfg)
    names, blocks = find_model_blocks(model, cfg.model)
    return model, param_groups(model, blocks, names)


def test_adapters_alone_have_gradients_and_optimizer_state() -> None:
    model, groups = _groups()
    adapters = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    base = sum(p.numel() for n, p in model.named_parameters() if ".lora_" not in n)
    counted = [g.bytes(shard=2, orig=4, compute=2) for g in groups]
    # fp32 adapters: their gradients (= `trained` bytes) and AdamW's 2 moments alone.
    assert sum(c.trained for c in counted) == 4 * adapters // 2
    # Stored: the base in bf16, the adapters in fp32 (every dim 0 here divides by 2 ranks).
    assert sum(c.params for c in counted) == (2 * base + 4 * adapters) // 2
    assert sum(c.trained_exact for c in counted) == adapters


def test_nf4_base_is_stored_in_half_a_byte_and_dequantized_one_weight_at_a_time() -> None:
    pytest.importorskip("torchao")
    model, groups = _groups("model.lora.quantize=nf4")
    block = groups[1]
    codes = [s for s, n in zip(block.shapes, block.param_names) if n.endswith(".nf4_data")]
    weights = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128  # wq wo, wk wv (GQA), w1 w3 w2
    assert sum(math.prod(s) for s in codes) == weights // 2
    assert block.transient_numel == 64 * 128  # the largest weight, not the block's sum
    counted = block.bytes(shard=1, orig=4, compute=2)
    adapters = sum(math.prod(s) for s, t in zip(block.shapes, block.trained) if t)
    # The codes (1 byte per 2 weights), int8 scalers (1 per 64), under 64 bytes of constants
    # per layer (7), and the block's two bf16 norms.
    frozen = counted.params - 4 * adapters
    assert weights // 2 + weights // 64 < frozen <= weights // 2 + weights // 64 + 7 * 64 + 256
    assert counted.gathered >= counted.params - 4 * adapters + 64 * 128 * 2
