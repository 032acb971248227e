"""The pre-flight memory report: meta measurements and the memory model against real CPU steps
(the command line is tests/test_report_cli.py's)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from checkpointing.planner.memory import estimate, sharded_numel
from checkpointing.planner.metatrace import FusedAttentionOnMeta, profile_on_meta
from checkpointing.planner.profile import OPTIONS, profile_blocks, trace_on_meta
from trainer.preflight.tables import collapse
from checkpointing.meter import SavedBytesMeter
from trainer.preflight.scenario import Evaluator, Scenario, setup_of
from checkpointing.wrap import resolve_ops
from trainer.distenv import init_distributed, read_env, shutdown
from tests.dist import spawn
from tests.helpers import config
from trainer.observe.livebytes import LiveTensorBytes, tensors_of
from trainer.build import build_model, build_on_meta, find_model_blocks
from trainer.cli import check
from trainer.config import DEFAULT_SAVE_OPS
from trainer.faults import LossGuard
from trainer.loop import StepParts, train_step
from trainer.models.llama import lm_loss
from trainer.optim import build_optimizer, build_scheduler
from trainer.state.resume import ModelState
from trainer.task import task_for

# Dropout off: with dropout, CPU attention takes the math path (T x T probabilities saved), which
# the report deliberately does not model (GPU kernels keep no such matrix).
TINY = ["model.dropout=0", "checkpointing.profile_repeats=1", "data.seq_len=128",
        "train.micro_batch_size=8"]
SMALL = TINY + ["model.dim=256", "model.n_layers=6", "model.n_heads=8", "model.n_kv_heads=4",
                "model.ffn_hidden=768", "train.micro_batch_size=4"]
# A Hugging Face Llama of the tiny model's shape, built from its config (model=hf).
HF = ["model.dropout=0", "checkpointing.profile_repeats=1", "data.seq_len=128",
      "train.micro_batch_size=8", "model=hf",
      "model.hf_config={model_type: llama, vocab_size: 256, hidden_size: 128, "
      "intermediate_size: 384, num_hidden_layers: 4, num_attention_heads: 4, "
      "num_key_value_heads: 2, max_position_embeddings: 512}"]
# A ViT at 256x256 (256 patch tokens + the class token).
VIT = ["model=vit_tiny", "model.image_size=256", "model.dim=64", "model.n_heads=2",
       "model.ffn_hidden=256", "model.n_layers=4", "train.micro_batch_size=4",
       "checkpointing.profile_repeats=1"]
POLICIES = [["checkpointing=none"], ["checkpointing=full"], ["checkpointing=selective"],
            ["checkpointing=budget", "checkpointing.budget=0.55"]]
# Measured agreement on CPU is within 0.3% (activations) and 0.7% (peak); these leave room for
# small changes in torch internals without hiding a missing term.
ACTIVATION_TOLERANCE = 0.02
PEAK_TOLERANCE = 0.03


# --- meta measurements ---------------------------------------------------------------------

def test_fused_attention_on_meta_keeps_what_a_flash_kernel_keeps() -> None:
    batch, heads, kv_heads, seq, head_dim = 2, 8, 2, 256, 16
    q = torch.empty(batch, heads, seq, head_dim, device="meta", requires_grad=True)
    k, v = (torch.empty(batch, kv_heads, seq, head_dim, device="meta", requires_grad=True)
            for _ in range(2))
    qkv_out_lse = (2 * q.numel() + k.numel() + v.numel() + batch * heads * seq) * 4
    for fused, expected in ((True, qkv_out_lse), (False, None)):
        meter = SavedBytesMeter()
        with meter.measure(), (FusedAttentionOnMeta() if fused else contextlib.nullcontext()):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        if expected is not None:  # kv heads are not expanded: no over-count for GQA
            assert meter.bytes == expected
        else:  # the math path keeps a T x T matrix per head, which no GPU kernel does
            assert meter.bytes > qkv_out_lse + batch * heads * seq * seq * 4


def test_meta_saved_bytes_equal_the_cpu_profile_of_the_tiny_model() -> None:
    cfg = config(*TINY)
    model = build_on_meta(cfg.model)
    names, blocks = find_model_blocks(model, cfg.model)
    tokens = torch.zeros(cfg.train.micro_batch_size, cfg.data.seq_len, dtype=torch.long,
                         device="meta")
    run = lambda m: lm_loss(m, tokens, tokens)  # noqa: E731
    ops = resolve_ops(DEFAULT_SAVE_OPS)
    meta = profile_on_meta(model, names, blocks, run, ops, DEFAULT_SAVE_OPS)
    trace = trace_on_meta(model, blocks, run)
    cpu = profile_blocks(blocks, trace, torch.device("cpu"), ops, repeats=1)
    for measured, predicted in zip(cpu, meta.blocks):
        for option in OPTIONS:
            real = measured.saved_bytes[option]
            assert abs(predicted.saved_bytes[option] - real) <= 0.02 * real, option
    assert meta.rest_bytes == trace.rest_saved_bytes
    block = meta.blocks[0]
    assert block.recompute_flops["full"] == block.forward_flops > 0
    assert block.recompute_flops["selective"] == 0  # every matmul and attention output is kept
    assert meta.head.grad_param_names == ("norm.weight", "output.weight")


def test_sharded_sizes_pad_dim0_like_fsdp() -> None:
    for shape in [(128256, 4096), (4096,), (7, 3), (1, 5)]:
        for shard in (1, 2, 3, 8, 64):
            chunk = torch.chunk(torch.empty(shape, device="meta"), shard, dim=0)[0]
            assert sharded_numel(shape, shard) == chunk.numel(), (shape, shard)


def test_identical_consecutive_blocks_collapse_into_one_row() -> None:
    rows = [{"name": f"layers.{i}", "recompute": "full" if i < 79 else "none",
             "saved_bytes": 1 if i < 79 else 2, "recompute_flops": 0} for i in range(80)]
    assert [name for name, _ in collapse(rows)] == ["layers.0-78 x79", "layers.79"]


def test_cpu_offload_leaves_only_transients_and_activations_on_the_device() -> None:
    outcomes = {}
    for offload in ("false", "true"):
        cfg, layout = check([*TINY, f"sharding.cpu_offload={offload}"], {"WORLD_SIZE": "2"})
        outcomes[offload] = Evaluator(tflops=400).evaluate(Scenario(cfg, layout, 2)).estimate
    on_gpu, offloaded = outcomes["false"], outcomes["true"]
    assert offloaded.host == on_gpu.params + on_gpu.grads + on_gpu.optimizer > 0 == on_gpu.host
    assert all(p.params == p.grads == p.optimizer == 0 for p in offloaded.phases)
    assert offloaded.peak.total < on_gpu.peak.total
    assert offloaded.activation_peak == on_gpu.activation_peak


# --- the memory model against real CPU steps -------------------------------------------------

@pytest.fixture(scope="module")
def world_of_one():
    with pytest.MonkeyPatch.context() as patch:
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
            patch.delenv(key, raising=False)
        init_distributed(read_env("cpu"), timeout_s=60)
        yield
        shutdown()


def _random_batch(cfg, task, generator) -> tuple:
    """Tensors of one micro-batch, ending with (inputs, targets)."""
    batch = cfg.train.micro_batch_size
    if task.kind == "lm":
        tokens = torch.randint(0, cfg.model.vocab_size, (batch, cfg.data.seq_len + 1),
                               generator=generator)
        targets = tokens[:, 1:].clone()
        if task.gather_rows:  # a chat batch: the planned share of each row learned, no more
            targets[:, round(task.meta_fraction * cfg.data.seq_len):] = -100
        return tokens, tokens[:, :-1], targets
    return (torch.randn(batch, *task.sample_shape, generator=generator),
            torch.randint(0, cfg.model.num_classes, (batch,), generator=generator))


def _measured_step(overrides: list[str], world: int = 1) -> dict:
    """One warm-up step, then one measured step of the trainer's own train_step (forward,
    backward, clipping, AdamW): its act_saved_bytes and the peak of live tensor bytes."""
    cfg, layout = check(overrides, {"WORLD_SIZE": str(world)})
    denv = read_env("cpu")
    meter = SavedBytesMeter()
    built = build_model(cfg, denv, layout, meter)
    optimizer = build_optimizer(built.model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, total_steps=10)
    generator = torch.Generator().manual_seed(denv.rank)
    guard = LossGuard(skip_nonfinite=True, max_bad=3, spike_factor=0, window=10)
    parts = StepParts(ModelState(built.model, optimizer, scheduler), 1.0, meter, built.offloader,
                      guard)
    task = task_for(cfg.model, cfg.data, cfg.checkpointing)
    for step in range(2):
        inputs = _random_batch(cfg, task, generator)
        batches = [inputs[-2:]]
        if step == 0:
            train_step(parts, batches, task.loss)
            continue
        with LiveTensorBytes(tensors_of(built.model, optimizer) + list(inputs)) as live:
            train_step(parts, batches, task.loss)
    return {"act_saved_bytes": meter.peak, "peak": live.peak,
            "plan": [p.recompute for p in built.plan]}


def _predicted(overrides: list[str], plan: list[str], world: int = 1):
    """The report's estimate for the plan the trainer made (CPU: AdamW's per-parameter loop)."""
    from checkpointing.plan import make_plan

    cfg, layout = check(overrides, {"WORLD_SIZE": str(world)})
    evaluator = Evaluator(tflops=400, optimizer_foreach=False)
    profile, groups, orig_dtype = evaluator.profile(cfg, layout.degree)
    shard = cfg.sharding.mode != "none"
    setup = setup_of(Scenario(cfg, layout, world), orig_dtype, optimizer_foreach=False)
    return estimate(groups, profile, make_plan(list(profile.block_names), plan, shard), setup)


def _assert_close(predicted: int, measured: int, tolerance: float, what: str) -> None:
    error = predicted / measured - 1
    print(f"{what}: predicted {predicted}, measured {measured} ({100 * error:+.2f}%)")
    assert abs(error) <= tolerance, f"{what}: {predicted} vs {measured} ({100 * error:+.2f}%)"


@pytest.mark.parametrize("model", ["tiny", "small", "hf", "vit"])
@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p[0].split("=")[1])
def test_predicted_memory_matches_a_real_cpu_step(world_of_one, model, policy) -> None:
    """Activation bytes kept at the end of the forward, and the peak of all live tensor bytes
    (parameters, gradients, optimizer state, FSDP's unsharded copies, activations) of a step
    with FSDP on a world of one. For budget, the prediction is for the plan the trainer chose
    (its costs come from CPU timings, the report's from FLOPs, so their plans can differ)."""
    overrides = {"tiny": TINY, "small": SMALL, "hf": HF, "vit": VIT}[model] + policy
    measured = _measured_step(overrides)
    predicted = _predicted(overrides, measured["plan"])
    _assert_close(predicted.end_of_forward, measured["act_saved_bytes"], ACTIVATION_TOLERANCE,
                  f"{model} {policy[0]} activations")
    _assert_close(predicted.peak.total, measured["peak"], PEAK_TOLERANCE,
                  f"{model} {policy[0]} peak ({predicted.peak.name})")
    if policy[0] == "checkpointing=budget":  # the report's own plan honours the budget too
        cfg, layout = check(overrides, {"WORLD_SIZE": "1"})
        outcome = Evaluator(tflops=400).evaluate(Scenario(cfg, layout, 1))
        assert outcome.estimate.end_of_forward <= outcome.budget.bytes


@pytest.mark.parametrize("model, policy", [("tiny", POLICIES[0]), ("tiny", POLICIES[2]),
                                           ("hf", POLICIES[1])], ids=["tiny-none",
                                                                      "tiny-selective", "hf-full"])
def test_predicted_memory_with_the_chunked_head(world_of_one, model, policy) -> None:
    """The chunked head's memory (a chunk's logits, the gradients it makes in the forward) as
    the report predicts it and a real CPU step measures it, within the same accuracy; with a
    vocabulary large enough that the plain head would set the peak."""
    overrides = ({"tiny": TINY, "hf": HF}[model] + policy +
                 ["model.vocab_size=4096", "checkpointing.head=chunked",
                  "checkpointing.head_chunk_tokens=64"])
    if model == "hf":
        overrides = [o.replace("vocab_size: 256", "vocab_size: 4096") for o in overrides]
    measured = _measured_step(overrides)
    predicted = _predicted(overrides, measured["plan"])
    _assert_close(predicted.peak.total, measured["peak"], PEAK_TOLERANCE,
                  f"{model} {policy[0]} chunked head peak ({predicted.peak.name})")


# A chat run with its head planned at 40% supervised rows (no files are read before a step).
CHAT_ROWS = ["data=chat", "data.path=chats.jsonl", "data.tokenizer=tok", "model.vocab_size=4096",
             "checkpointing.head_supervised_fraction=0.4"]


@pytest.mark.parametrize("head", ["plain", "chunked"])
def test_predicted_memory_of_the_head_on_supervised_rows(world_of_one, head) -> None:
    """The head on a chat batch's supervised rows (checkpointing.head_rows=supervised): its
    predicted bytes scale with the planned share, and the peak matches a real CPU step whose
    batch learns that share of its targets."""
    overrides = TINY + POLICIES[0] + CHAT_ROWS + [f"checkpointing.head={head}",
                                                  "checkpointing.head_chunk_tokens=64"]
    measured = _measured_step(overrides)
    predicted = _predicted(overrides, measured["plan"])
    _assert_close(predicted.peak.total, measured["peak"], PEAK_TOLERANCE,
                  f"{head} head on 40% of the rows, peak ({predicted.peak.name})")
    heads = {}
    for rows in ("all", "supervised"):
        cfg, _ = check(overrides + [f"checkpointing.head_rows={rows}"], {"WORLD_SIZE": "1"})
        measure = Evaluator(tflops=400).profile(cfg)[0].head
        heads[rows] = measure.saved_bytes + measure.extra_bytes
    # 410 of 1,024 rows, padded to 416. The plain head's logits scale with them; the chunked
    # head holds one chunk's logits and the weight's gradient whatever the rows (its saving is
    # FLOPs), and the hidden states' gradient, which scales.
    ratio = heads["supervised"] / heads["all"]
    assert (0.35 < ratio < 0.5) if head == "plain" else (0.5 < ratio < 0.9), heads


def _two_rank_step(rank: int, world_size: int, overrides: list[str]) -> dict:
    return _measured_step(overrides, world=world_size)


@pytest.mark.slow
def test_predicted_peak_matches_two_ranks_with_prefetch() -> None:
    """With two shards FSDP prefetches the next block's all-gather and pads dim 0 (vocab 301)."""
    overrides = TINY + ["data.seq_len=128", "train.micro_batch_size=4", "model.vocab_size=301",
                        "checkpointing=selective"]
    results = spawn(_two_rank_step, 2, overrides)
    predicted = _predicted(overrides, results[0]["plan"], world=2)
    for result in results:
        _assert_close(predicted.peak.total, result["peak"], PEAK_TOLERANCE, "two ranks peak")


# --- the command line ----------------------------------------------------------------------
