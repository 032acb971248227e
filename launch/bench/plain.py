"""The plain-PyTorch reference of the GPU check and of `python -m launch.bench
--reference`: nothing of blocktrain's, only torch (and transformers for an HF model).

    python -m launch.bench.plain --policy full --micro-batch 8 --seq 4096 [shape flags]
    torchrun --nproc-per-node 2 -m launch.bench.plain --policy full --hf-config '{...}'

The loop a user would write by hand around the same arithmetic as blocktrain's: `fully_shard`
per block and on the root, `torch.utils.checkpoint` per block for `full`, selective checkpoint
contexts keeping matmul and attention outputs for `selective`, AdamW with the same parameter
groups, warmup-cosine schedule and gradient clipping, the same synthetic data order and the same
per-parameter initialisation. The Llama below is blocktrain's written out op for op (names,
interleaved rotary from fp32 cos/sin tables, RMSNorm in fp32, SwiGLU, causal SDPA with grouped
kv heads, residual dropout); `--hf-config` trains a transformers causal LM instead. So the losses
can be compared with the trainer's exactly, and its dispatched operators one for one. Prints one
JSON line: tokens/s per step, memory high-water marks, losses (the mean over ranks).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import sys
import time
from datetime import timedelta
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

# blocktrain's defaults (conf/optim/adamw.yaml), so the arithmetic and the losses agree.
LR, MIN_LR_RATIO, LR_WARMUP, WEIGHT_DECAY, BETAS, EPS, GRAD_CLIP = (
    0.003, 0.1, 20, 0.1, (0.9, 0.95), 1e-8, 1.0)
WINDOWS = 1 << 20  # synthetic training windows (blocktrain's data=synthetic)


class Norm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(width))

    def forward(self, x):
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)


def rotate(x, rope):
    """x: [batch, seq, heads, head_dim]; feature pairs (2i, 2i+1) turned by position."""
    cos, sin = (t[: x.shape[1]].view(1, x.shape[1], 1, -1) for t in rope)
    pairs = x.float().unflatten(-1, (-1, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    turned = torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1)
    return turned.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, a) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head, self.dropout = (
            a.heads, a.kv_heads, a.dim // a.heads, a.dropout)
        self.wq = nn.Linear(a.dim, a.heads * self.head, bias=False)
        self.wk = nn.Linear(a.dim, a.kv_heads * self.head, bias=False)
        self.wv = nn.Linear(a.dim, a.kv_heads * self.head, bias=False)
        self.wo = nn.Linear(a.heads * self.head, a.dim, bias=False)

    def forward(self, x, rope):
        b, t, _ = x.shape
        q = rotate(self.wq(x).view(b, t, self.heads, self.head), rope)
        k = rotate(self.wk(x).view(b, t, self.kv_heads, self.head), rope)
        v = self.wv(x).view(b, t, self.kv_heads, self.head)
        q, k, v = (u.transpose(1, 2) for u in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             dropout_p=self.dropout if self.training else 0.0,
                                             enable_gqa=self.kv_heads != self.heads)
        return self.wo(out.transpose(1, 2).reshape(b, t, self.heads * self.head))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self, a) -> None:
        super().__init__()
        # In blocktrain's order: the parameters' order is the gradient norm's summation order.
        self.attention_norm = Norm(a.dim, 1e-5)
        self.attention = Attention(a)
        self.ffn_norm = Norm(a.dim, 1e-5)
        self.feed_forward = FeedForward(a.dim, a.ffn)
        self.residual_dropout = nn.Dropout(a.dropout)

    def forward(self, x, rope):
        h = x + self.residual_dropout(self.attention(self.attention_norm(x), rope))
        return h + self.residual_dropout(self.feed_forward(self.ffn_norm(h)))


class Decoder(nn.Module):
    def __init__(self, a) -> None:
        super().__init__()
        self.a = a
        self.tok_embeddings = nn.Embedding(a.vocab, a.dim)
        self.layers = nn.ModuleList(Layer(a) for _ in range(a.layers))
        self.norm = Norm(a.dim, 1e-5)
        self.output = nn.Linear(a.dim, a.vocab, bias=False)
        self.tie()

    def tie(self) -> None:
        if not self.a.untied:  # as Llama 3.2 1B
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens):
        head_dim = self.a.dim // self.a.heads
        where = tokens.device
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=where) / head_dim
        positions = torch.arange(tokens.shape[1], dtype=torch.float32, device=where)
        angles = torch.outer(positions, 1.0 / (self.a.rope_theta ** exponents))
        rope = torch.cos(angles), torch.sin(angles)
        hidden = self.tok_embeddings(tokens)
        for layer in self.layers:
            hidden = layer(hidden, rope)
        return self.output(self.norm(hidden))

    def std(self, name: str, param: torch.Tensor):
        """Init std of a parameter (None: ones), blocktrain's rules for its Llama."""
        if name.endswith("norm.weight"):
            return None
        if name == "output.weight" and self.a.untied:
            return self.a.dim ** -0.5
        if name.endswith(("wo.weight", "w2.weight")):
            return 0.02 / math.sqrt(2 * self.a.layers)
        return 0.02


class HFLM(nn.Module):
    """A transformers causal LM, called as the Llama above: tokens -> logits."""

    def __init__(self, fields: dict, device: torch.device) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        fields = dict(fields)
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        config._attn_implementation = "sdpa"
        self.hf = AutoModelForCausalLM.from_config(config).to(device).train()
        self.range = float(getattr(config, "initializer_range", 0.02))

    @property
    def layers(self) -> nn.ModuleList:
        return self.hf.get_decoder().layers

    def forward(self, tokens):
        return self.hf(input_ids=tokens, use_cache=False).logits

    def std(self, name: str, param: torch.Tensor):
        """blocktrain's rule for HF models: matrices N(0, initializer_range), biases 0,
        other vectors 1."""
        return self.range if param.ndim >= 2 else None


# blocktrain's checkpointing.save_ops default: matmuls and attention (on CUDA and on the CPU).
_ATTENTION = {torch.ops.aten._scaled_dot_product_flash_attention.default,
              torch.ops.aten._scaled_dot_product_efficient_attention.default,
              torch.ops.aten._scaled_dot_product_cudnn_attention.default,
              torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
_KEEP = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
         torch.ops.aten.baddbmm.default, *_ATTENTION}


def _keep_matmuls(ctx, op, *args, **kwargs):
    # Attention with dropout is recomputed: kept, its recompute would skip the draw of its mask
    # and shift every later mask of the block.
    drops = op in _ATTENTION and kwargs.get("dropout_p", args[3] if len(args) > 3 else 0.0)
    return (CheckpointPolicy.MUST_SAVE if op in _KEEP and not drops
            else CheckpointPolicy.PREFER_RECOMPUTE)


def with_recompute(layer: nn.Module, policy: str) -> None:
    """Wrap the layer's forward (this instance only) in the chosen activation checkpointing."""
    if policy == "none":
        return
    inner = layer.forward
    contexts = ({"context_fn": partial(create_selective_checkpoint_contexts, _keep_matmuls)}
                if policy == "selective" else {})

    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **contexts, **kwargs)

    layer.forward = forward


@torch.no_grad()
def init_weights(model: nn.Module, seed: int, prefix: str, device: torch.device) -> None:
    """Each parameter's full value from its own generator seeded by (seed, name), this rank
    keeping its dim-0 chunk: the numbers do not depend on the world size."""
    for name, p in model.named_parameters():
        name = name[len("hf."):] if name.startswith("hf.") else name
        digest = hashlib.blake2b(f"{seed}/{prefix}{name}".encode(), digest_size=8).digest()
        generator = torch.Generator(device=device).manual_seed(
            int.from_bytes(digest, "little") & (2**63 - 1))
        full, std = torch.empty(p.shape, dtype=p.dtype, device=device), model.std(name, p)
        if std is None:
            full.fill_(0.0 if name.endswith("bias") else 1.0)
        else:
            sample = torch.empty(p.shape, dtype=torch.float32, device=device)
            full.copy_(sample.normal_(0.0, std, generator=generator))
        local = p.to_local() if hasattr(p, "to_local") else p
        world, rank = dist.get_world_size(), dist.get_rank()
        chunks = torch.chunk(full, world)
        local.copy_(chunks[rank] if rank < len(chunks) else full[:0])


def batches(a, rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's (inputs, targets) of every step: uniform random windows, window k drawn from
    (seed, 0, k), global sample g reading window permutation[g] (one epoch)."""
    order = np.random.default_rng([a.seed, 0]).permutation(WINDOWS)
    out = []
    for step in range(a.steps):
        first = (step * world + rank) * a.micro_batch
        windows = torch.stack([torch.from_numpy(
            np.random.default_rng([a.seed, 0, int(k)]).integers(0, a.vocab, size=a.seq + 1))
            for k in order[first:first + a.micro_batch]])
        out.append((windows[:, :-1].contiguous(), windows[:, 1:].contiguous()))
    return out


def lr_factor(step: int, total: int) -> float:
    warmup = min(LR_WARMUP, total)
    if step < warmup:
        return LR * (step + 1) / warmup / LR
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))
    return LR * (MIN_LR_RATIO + (1.0 - MIN_LR_RATIO) * cosine) / LR


def setup(a) -> tuple[torch.device, int, int]:
    """The process group: torchrun's when started by it, else a world of one in memory."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(a.device if a.device != "cuda" else f"cuda:{local}")
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    kwargs = dict(timeout=timedelta(minutes=5), device_id=device if cuda else None)
    if "RANK" in os.environ:
        dist.init_process_group(backend, **kwargs)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    return device, dist.get_rank(), dist.get_world_size()


def build(a, device: torch.device) -> nn.Module:
    if a.hf_config:
        model = HFLM(json.loads(a.hf_config), device)
    else:
        with torch.device("meta"):
            model = Decoder(a)
    mp = (MixedPrecisionPolicy() if a.param_dtype == "none" else
          MixedPrecisionPolicy(param_dtype=getattr(torch, a.param_dtype),
                               reduce_dtype=torch.float32))
    for i, layer in enumerate(model.layers):
        with_recompute(layer, a.policy)
        # Only the hidden state is cast: the rotary tables stay fp32. The last block's
        # parameters stay gathered for its backward, which comes first.
        fully_shard(layer, mp_policy=MixedPrecisionPolicy(
            mp.param_dtype, mp.reduce_dtype, cast_forward_inputs=False),
            reshard_after_forward=i != len(model.layers) - 1)
    # The root too frees its parameters after forward (torch's default keeps them), as
    # blocktrain's sharding.reshard_after_forward=true does: the same all-gathers and peak.
    fully_shard(model, mp_policy=mp, reshard_after_forward=True)
    if not a.hf_config:
        model.to_empty(device=device)
        model.tie()  # to_empty replaced each module's parameter
    init_weights(model, a.seed, "hf." if a.hf_config else "", device)
    return model


def train(a, model: nn.Module, device: torch.device, data) -> tuple[list[float], list[float]]:
    """The loop: forward, loss, backward, clip, step; the loss read once a step."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY},
                                   {"params": rest, "weight_decay": 0.0}],
                                  lr=LR, betas=BETAS, eps=EPS)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, partial(lr_factor, total=a.steps))
    times, losses = [], []
    for inputs, targets in data:
        started = time.perf_counter()
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # waits for the step, as a training loop's logging does
        times.append(time.perf_counter() - started)
    return times, losses


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("dim", 2048), ("layers", 16), ("heads", 32), ("kv-heads", 8),
                          ("ffn", 8192), ("vocab", 128256), ("seq", 4096), ("micro-batch", 1),
                          ("steps", 8), ("warmup", 2), ("seed", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--rope-theta", type=float, default=500000.0)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--untied", action="store_true", help="a separate output matrix")
    p.add_argument("--hf-config", default=None, help="JSON: a transformers model_type and fields")
    p.add_argument("--policy", choices=("none", "full", "selective"), default="full")
    p.add_argument("--param-dtype", choices=("bfloat16", "float32", "none"), default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    device, rank, world = setup(a)
    if a.hf_config:
        a.vocab = json.loads(a.hf_config).get("vocab_size", a.vocab)
    model = build(a, device)
    torch.manual_seed(a.seed + rank)  # dropout masks differ per rank, as blocktrain's
    times, losses = train(a, model, device, batches(a, rank, world))
    mean = torch.tensor(losses, dtype=torch.float32)  # the losses as they were, fp32
    dist.all_reduce(mean)
    mean /= world
    timed = times[a.warmup:] or times
    cuda = device.type == "cuda"
    result = {"policy": a.policy, "micro_batch": a.micro_batch, "seq": a.seq,
              "tokens_per_s": [a.micro_batch * a.seq / t for t in timed],
              "step_time_s": times, "losses": mean.tolist(),
              "max_memory_allocated": torch.cuda.max_memory_allocated(device) if cuda else None,
              "max_memory_reserved": torch.cuda.max_memory_reserved(device) if cuda else None,
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "torch": torch.__version__}
    if rank == 0:
        print(json.dumps(result), flush=True)
    # A rank tearing down its gloo pairs while a peer still sends aborts the peer; the store
    # (not those pairs) tells when everyone is done.
    dist.barrier()
    store = dist.distributed_c10d._get_default_store()
    store.add("reference/done", 1)
    deadline = time.monotonic() + 60
    while store.add("reference/done", 0) < world and time.monotonic() < deadline:
        time.sleep(0.01)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
