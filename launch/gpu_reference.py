"""The plain-PyTorch reference of the GPU check: nothing of blocktrain's, only torch.

    python -m launch.gpu_reference --policy full --micro-batch 8 --seq 4096 [shape flags]

A Llama written out here (same shapes and the same arithmetic as blocktrain's: separate q/k/v
projections, interleaved rotary in fp32, RMSNorm in fp32, SwiGLU, causal SDPA with grouped kv
heads, tied embeddings), `fully_shard` per block and on the root with bf16 parameters and fp32
reductions, `torch.utils.checkpoint` for `full`, selective checkpoint contexts that keep matmul
and attention outputs for `selective`, and AdamW with gradient clipping. It imports nothing from
this repository, so the GPU check's figures for blocktrain are ratios against what a user would
write by hand. Prints one JSON line: tokens/s per step, memory high-water marks, losses.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)


class Norm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(width))

    def forward(self, x):
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)


def rotate(x, freqs):
    """x: [batch, seq, heads, head_dim]; freqs: complex [seq, head_dim / 2]."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    turned = pairs * freqs[: x.shape[1]].view(1, x.shape[1], 1, -1)
    return torch.view_as_real(turned).flatten(-2).type_as(x)


class Layer(nn.Module):
    def __init__(self, a) -> None:
        super().__init__()
        head = a.dim // a.heads
        self.heads, self.kv_heads, self.head = a.heads, a.kv_heads, head
        self.norm1, self.norm2 = Norm(a.dim, 1e-5), Norm(a.dim, 1e-5)
        self.q = nn.Linear(a.dim, a.heads * head, bias=False)
        self.k = nn.Linear(a.dim, a.kv_heads * head, bias=False)
        self.v = nn.Linear(a.dim, a.kv_heads * head, bias=False)
        self.o = nn.Linear(a.heads * head, a.dim, bias=False)
        self.gate = nn.Linear(a.dim, a.ffn, bias=False)
        self.up = nn.Linear(a.dim, a.ffn, bias=False)
        self.down = nn.Linear(a.ffn, a.dim, bias=False)

    def attend(self, x, freqs):
        b, t, _ = x.shape
        q = rotate(self.q(x).view(b, t, self.heads, self.head), freqs).transpose(1, 2)
        k = rotate(self.k(x).view(b, t, self.kv_heads, self.head), freqs).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.head).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=self.kv_heads != self.heads)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))

    def forward(self, x, freqs):
        x = x + self.attend(self.norm1(x), freqs)
        y = self.norm2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class Decoder(nn.Module):
    def __init__(self, a) -> None:
        super().__init__()
        self.a = a
        self.embed = nn.Embedding(a.vocab, a.dim)
        self.layers = nn.ModuleList(Layer(a) for _ in range(a.layers))
        self.norm = Norm(a.dim, 1e-5)
        self.head = nn.Linear(a.dim, a.vocab, bias=False)
        self.head.weight = self.embed.weight  # tied, as Llama 3.2 1B

    def forward(self, tokens):
        head_dim = self.a.dim // self.a.heads
        inv = self.a.rope_theta ** -(torch.arange(0, head_dim, 2, device=tokens.device)
                                     .float() / head_dim)
        angles = torch.outer(torch.arange(tokens.shape[1], device=tokens.device).float(), inv)
        freqs = torch.polar(torch.ones_like(angles), angles)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, freqs)
        return self.head(self.norm(x))


_KEEP = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
         torch.ops.aten._scaled_dot_product_flash_attention.default,
         torch.ops.aten._scaled_dot_product_efficient_attention.default,
         torch.ops.aten._scaled_dot_product_cudnn_attention.default}


def _keep_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _KEEP else CheckpointPolicy.PREFER_RECOMPUTE


def with_recompute(layer: Layer, policy: str) -> None:
    """Wrap the layer's forward (this instance only) in the chosen activation checkpointing."""
    if policy == "none":
        return
    inner = layer.forward
    contexts = (partial(create_selective_checkpoint_contexts, _keep_matmuls)
                if policy == "selective" else None)

    def forward(x, freqs):
        if contexts is None:
            return checkpoint(inner, x, freqs, use_reentrant=False)
        return checkpoint(inner, x, freqs, use_reentrant=False, context_fn=contexts)

    layer.forward = forward


def init_weights(model: nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    depth_scale = 0.02 / math.sqrt(2 * model.a.layers)
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        with torch.no_grad():
            if p.ndim == 1:
                local.fill_(1.0)
            else:
                local.normal_(0.0, depth_scale if name.endswith(("o.weight", "down.weight"))
                              else 0.02)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("dim", 2048), ("layers", 16), ("heads", 32), ("kv-heads", 8),
                          ("ffn", 8192), ("vocab", 128256), ("seq", 4096), ("micro-batch", 1),
                          ("steps", 8), ("warmup", 2)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--rope-theta", type=float, default=500000.0)
    p.add_argument("--policy", choices=("none", "full", "selective"), default="full")
    p.add_argument("--param-dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo", store=dist.HashStore(),
                            rank=0, world_size=1, timeout=timedelta(minutes=5),
                            device_id=device if cuda else None)
    with torch.device("meta"):
        model = Decoder(a)
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, a.param_dtype),
                              reduce_dtype=torch.float32)
    for layer in model.layers:
        with_recompute(layer, a.policy)
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    model.to_empty(device=device)
    model.head.weight = model.embed.weight  # to_empty replaced each module's parameter
    init_weights(model, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    generator = torch.Generator(device=device).manual_seed(0)
    times, losses = [], []
    for _ in range(a.steps):
        tokens = torch.randint(0, a.vocab, (a.micro_batch, a.seq + 1), device=device,
                               generator=generator)
        started = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # waits for the step, as a training loop's logging does
        times.append(time.perf_counter() - started)
    tokens_per_step = a.micro_batch * a.seq
    timed = times[a.warmup:] or times
    result = {"policy": a.policy, "micro_batch": a.micro_batch, "seq": a.seq,
              "tokens_per_s": [tokens_per_step / t for t in timed],
              "step_time_s": times, "losses": losses,
              "max_memory_allocated": torch.cuda.max_memory_allocated(device) if cuda else None,
              "max_memory_reserved": torch.cuda.max_memory_reserved(device) if cuda else None,
              "torch": torch.__version__}
    print(json.dumps(result), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
