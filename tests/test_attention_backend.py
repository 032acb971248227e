"""model.attention (issue 44): the backend choice, its checks, and the GPU kernels' backward
workspace counted in the meta trace from each kernel's own allocation rule
(checkpointing/planner/attention_workspace.py)."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr

import pytest
import torch
import torch.nn.functional as F

from checkpointing.planner.attention_workspace import (ASSUMED_GPU, Gpu, auto_backend,
                                                       backward_workspace_bytes, refusal,
                                                       workspace_rule)
from checkpointing.planner.metatrace import measure_block, profile_on_meta
from checkpointing.wrap import resolve_ops
from trainer import cli
from trainer.models.llama import LlamaArgs, build_llama, lm_loss

GIB = 2**30


def test_flash_rule_at_llama_8b_one_million_tokens() -> None:
    """FlashAttention-2's mha_bwd: fp32 dq_accum [B, round128(T), H, round32(D)], fp32
    softmax_d [B, H, round128(T)] and, for 32 query heads over 8 KV heads, dK/dV expanded to
    32 heads in bf16: 16 GiB + 128 MiB + 16 GiB, the issue's "+30 GiB"."""
    tokens, heads, kv, dim = 1_048_576, 32, 8, 128
    got = backward_workspace_bytes("flash", 1, heads, kv, tokens, tokens, dim, "bfloat16")
    assert got == 16 * GIB + 128 * 2**20 + 2 * 8 * GIB
    # cuDNN's frontend: fp32 dQ_accum [B, H, T, D] and softmax_sum [B, H, T]; its grouped-query
    # full-head dK/dV are virtual for dense inputs.
    assert backward_workspace_bytes("cudnn", 1, heads, kv, tokens, tokens, dim,
                                    "bfloat16") == 16 * GIB + 128 * 2**20
    # Without grouped-query heads flash expands nothing.
    assert backward_workspace_bytes("flash", 1, heads, heads, tokens, tokens, dim,
                                    "bfloat16") == 16 * GIB + 128 * 2**20
    assert backward_workspace_bytes("math", 1, heads, kv, tokens, tokens, dim, "bfloat16") == 0


@pytest.mark.parametrize("tokens,dim,q_rounded,d_rounded", [
    (1000, 128, 1024, 128), (128, 80, 128, 96), (129, 160, 256, 192), (4096, 256, 4096, 256)])
def test_flash_rule_rounds_as_mha_bwd(tokens: int, dim: int, q_rounded: int,
                                      d_rounded: int) -> None:
    """Sequence rounded up to 128, head size to 32 (<= 128) or 64 (above), as mha_bwd does."""
    batch, heads = 2, 4
    want = batch * heads * q_rounded * 4 + batch * q_rounded * heads * d_rounded * 4
    assert backward_workspace_bytes("flash", batch, heads, heads, tokens, tokens, dim,
                                    "float16") == want


def test_efficient_rule() -> None:
    """CUTLASS backward: fp32 delta [B, H, T], an fp32 grad-q accumulator for 16-bit outputs
    (none for fp32), and expanded dK/dV for grouped heads."""
    b, h, t, d = 2, 8, 512, 64
    assert backward_workspace_bytes("efficient", b, h, h, t, t, d, "float32") == b * h * t * 4
    assert backward_workspace_bytes("efficient", b, h, 2, t, t, d, "bfloat16") == (
        b * h * t * 4 + b * h * t * d * 4 + 2 * b * t * h * d * 2)


def test_rule_reads_the_cpu_flash_backward_shapes() -> None:
    """The meta trace's stand-in op carries q [B, H, T, D] and k [B, KV, T, D]: the rule reads
    them there and nowhere else."""
    rule = workspace_rule("flash")
    q = torch.empty(1, 4, 256, 32, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k = torch.empty(1, 2, 256, 32, device="meta", dtype=torch.bfloat16, requires_grad=True)
    seen = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(rule(func, args))
            return func(*args, **(kwargs or {}))

    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, k, 0.0, True)
    with Spy():
        out.sum().backward()
    want = backward_workspace_bytes("flash", 1, 4, 2, 256, 256, 32, "bfloat16")
    assert want > 0 and want in seen and set(seen) <= {0, want}
    assert workspace_rule(None) is None  # a CPU run
    math = workspace_rule("math")  # a GPU's math path keeps T x T itself: nothing added here
    flash_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    assert math is not None and math(flash_op, (None, q, k)) == 0


def test_rule_counts_the_rings_efficient_backward_whatever_the_backend() -> None:
    """Ring attention calls CUDA's memory-efficient backward itself (sharding/ring_kernels.py):
    its fp32 dq accumulator and delta count under any GPU backend."""
    q = torch.empty(1, 1, 512, 64, device="meta", dtype=torch.bfloat16)
    k = torch.empty(1, 1, 256, 64, device="meta", dtype=torch.bfloat16)
    op = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default
    want = backward_workspace_bytes("efficient", 1, 1, 1, 512, 256, 64, "bfloat16")
    assert want == 512 * 4 + 512 * 64 * 4
    for backend in ("cudnn", "flash", "efficient", "math"):
        assert workspace_rule(backend)(op, (None, q, k)) == want


def _block_inputs(args: LlamaArgs, tokens: int, dtype: torch.dtype):
    model = build_llama(args).to(dtype)
    block = model.layers[0]
    from trainer.models.rope import rope_cos_sin

    hidden = torch.empty(1, tokens, args.dim, device="meta", dtype=dtype, requires_grad=True)
    return model, block, (hidden, rope_cos_sin(args.head_dim, tokens, 10000.0, "meta"))


def test_live_bytes_add_the_workspace_at_the_attention_backward() -> None:
    """Around attention alone the workspace, alive with q, k, v, the output, dq, dk and dv while
    the backward op runs, sets the peak: it rises, by at most the rule's bytes (the gradients'
    accumulation after the op held the peak before)."""
    from checkpointing.planner.metatrace import LiveBytes

    def peak(rule) -> tuple[int, int]:
        q = torch.empty(2, 8, 1024, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
        kv = torch.empty(2, 2, 1024, 64, device="meta", dtype=torch.bfloat16, requires_grad=True)
        live = LiveBytes(rule)
        with live:
            out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, kv, kv, 0.0,
                                                                                 True)
            live.reset_peak()
            out.backward(torch.ones_like(out))
        return live.peak, live.workspace_peak

    plain, flash = peak(None), peak(workspace_rule("flash"))
    want = backward_workspace_bytes("flash", 2, 8, 2, 1024, 1024, 64, "bfloat16")
    assert plain[1] == 0 and flash[1] == want
    assert plain[0] < flash[0] <= plain[0] + want


def test_meta_trace_records_the_workspace_per_block() -> None:
    """A Llama block measured for flash records the rule's bytes for its attention and never
    predicts less than without them; what it keeps for backward is unchanged."""
    args = LlamaArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=1, vocab_size=32, ffn_hidden=64,
                     max_seq_len=4096)
    _, block, inputs = _block_inputs(args, 4096, torch.bfloat16)
    ops = resolve_ops(["mm"])
    plain = measure_block(block, inputs, {}, ops, ["mm"])
    flash = measure_block(block, inputs, {}, ops, ["mm"], attention="flash")
    assert flash.workspace_bytes == backward_workspace_bytes("flash", 1, 4, 1, 4096, 4096, 16,
                                                             "bfloat16")
    assert plain.workspace_bytes == 0 and flash.saved_bytes == plain.saved_bytes
    assert all(flash.peak_bytes[o] >= peak for o, peak in plain.peak_bytes.items())


def test_cpu_prediction_counts_no_workspace() -> None:
    """like_cpu (train.device=cpu, the live-bytes comparisons): no CUDA kernel runs, so nothing
    is added whatever backend is named."""
    args = LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32, ffn_hidden=64,
                     max_seq_len=256)
    model = build_llama(args)
    tokens = torch.zeros(1, 256, dtype=torch.long, device="meta")
    blocks = list(model.layers)
    names = [f"layers.{i}" for i in range(len(blocks))]

    def run(m):
        return lm_loss(m, tokens, tokens)

    ops = resolve_ops(["mm"])
    plain = profile_on_meta(model, names, blocks, run, ops, ["mm"], like_cpu=True)
    named = profile_on_meta(model, names, blocks, run, ops, ["mm"], like_cpu=True,
                            attention="flash")
    assert named.blocks == plain.blocks and named.attention_workspace_bytes == 0
    assert named.attention_backend is None


def test_auto_follows_the_dispatchers_order() -> None:
    """cuDNN first on sm90 with cuDNN > 9.15, flash first on sm80 or an older cuDNN, efficient for
    fp32, the CPU's flash kernel without dropout, math with it."""
    assert auto_backend("cuda", "bfloat16", 128, 0.0, ASSUMED_GPU) == "cudnn"
    assert auto_backend("cuda", "bfloat16", 128, 0.0, Gpu(8, 0, 91600)) == "flash"
    assert auto_backend("cuda", "bfloat16", 128, 0.0, Gpu(9, 0, 91000)) == "flash"
    assert auto_backend("cuda", "float32", 128, 0.0, ASSUMED_GPU) == "efficient"
    assert auto_backend("cuda", "bfloat16", 512, 0.0, Gpu(8, 0, 90100)) == "efficient"
    assert auto_backend("cpu", "float32", 64, 0.0) == "flash"
    assert auto_backend("cpu", "float32", 64, 0.1) == "math"
    assert refusal("cudnn", "cuda", "bfloat16", 128, 0.1, ASSUMED_GPU) is not None  # not n/16
    assert refusal("flash", "cuda", "bfloat16", 128, 0.0, Gpu(7, 5, 90100)) is not None


def _check(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with redirect_stderr(err):
        status = cli.check_command(argv, {})
    return status, err.getvalue().strip()


@pytest.mark.parametrize("argv,says", [
    (["model.attention=cudnn", "train.device=cpu"], "cudnn is a CUDA kernel"),
    (["model.attention=efficient", "train.device=cpu"], "efficient is a CUDA kernel"),
    (["model.attention=flash", "train.device=cpu", "model.dropout=0.1"], "no attention dropout"),
    (["model.attention=flash", "train.device=cuda", "sharding.param_dtype=float32"],
     "bfloat16/float16 only"),
    (["model.attention=cudnn", "train.device=cuda", "sharding.param_dtype=bfloat16",
      "model.dim=512", "model.n_heads=2", "model.n_kv_heads=2"], "head_dim <= 128"),
    (["model.attention=fast"], "model.attention"),
])
def test_a_backend_the_run_cannot_use_is_one_line_exit_2(argv: list[str], says: str) -> None:
    status, printed = _check(["model=tiny", "data=synthetic", *argv])
    assert status == 2 and len(printed.splitlines()) == 1, printed
    assert printed.startswith("error: model.attention") and says in printed, printed


def test_runnable_backends_pass() -> None:
    from trainer.config import Config, ModelConfig, ShardingConfig, TrainConfig
    from trainer.models.families.attention_backend import check_attention, resolve

    for argv in (["model.attention=flash", "train.device=cpu"],
                 ["model.attention=math", "train.device=cpu"], ["model.attention=auto"]):
        status, printed = _check(["model=tiny", "data=synthetic", *argv])
        assert status == 0, printed
    # A GPU run planned on this CPU host: checked against the assumed sm90 with cuDNN 9.16.
    cfg = Config(model=ModelConfig(attention="cudnn"), train=TrainConfig(device="cuda"),
                 sharding=ShardingConfig(param_dtype="bfloat16"))
    check_attention(cfg)
    auto = Config(model=ModelConfig(), sharding=ShardingConfig(param_dtype="bfloat16"))
    backend, why = resolve(auto, "cuda", None if torch.cuda.is_available() else ASSUMED_GPU)
    assert backend in ("cudnn", "flash") and why.startswith("auto: sm")


def test_explicit_backend_holds_cpu_attention_to_it() -> None:
    """model.attention=math runs the built-in Llama's attention under sdpa_kernel(MATH): the
    fused CPU kernel is never called, and the numbers agree with the unrestricted run."""
    from trainer.config import Config, ModelConfig, TrainConfig
    from trainer.models.families.attention_backend import apply_attention

    args = LlamaArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=32, ffn_hidden=64,
                     max_seq_len=16)
    torch.manual_seed(0)
    model = build_llama(args, device="cpu")
    tokens = torch.randint(0, 32, (2, 16))
    reference = lm_loss(model, tokens, tokens)
    cfg = Config(model=ModelConfig(attention="math"), train=TrainConfig(device="cpu"))
    assert apply_attention(cfg, model, torch.device("cpu"), say=False) == "math"
    called = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            called.append(str(func))
            return func(*args, **(kwargs or {}))

    with Spy():
        loss = lm_loss(model, tokens, tokens)
    assert not any("flash" in name for name in called)
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-6)


def test_report_writes_the_attention_keys(tmp_path) -> None:
    """memory_plan.json names the kernel counted and its workspace, which is inside the peak."""
    from trainer.report import main

    out = tmp_path / "report"
    main(["--gpu-memory-gib", "80", "--out", str(out), "model=tiny", "data=synthetic",
          "data.seq_len=512", "model.max_seq_len=512", "sharding.param_dtype=bfloat16",
          "model.attention=flash", "train.micro_batch_size=2"])
    data = json.loads((out / "memory_plan.json").read_text())
    assert data["attention_backend"] == "flash"
    # tiny: 4 heads of 32 over 2 KV heads, bf16, 2 x 512 tokens
    assert data["attention_workspace_bytes"] == backward_workspace_bytes(
        "flash", 2, 4, 2, 512, 512, 32, "bfloat16")
    main(["--gpu-memory-gib", "80", "--out", str(out), "model=tiny", "data=synthetic",
          "train.device=cpu"])
    data = json.loads((out / "memory_plan.json").read_text())
    assert data["attention_backend"] == "flash" and data["attention_workspace_bytes"] == 0
