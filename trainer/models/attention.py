"""The one place attention can be swapped: each attention module calls its `attend` function.

Every family's attention module computes q, k and v, calls

    out = module.attend(q, k, v, **options)   # q [B, heads, T, head_dim], k/v [B, kv_heads, T,
                                              # head_dim]; out [B, heads, T, head_dim]

and projects `out`. `options` are the model's own (a mask, dropout, grouped-query heads, the
scale) and pass through untouched. Sequence parallelism (Ulysses) wraps `attend`: an all-to-all
turns a rank's share of the tokens of every head into every token of its share of the heads,
the wrapped function attends over whole sequences, and an all-to-all turns it back.

How a family's modules come to call `attend`:
- the built-in Llama and ViT call `self.attend` in their forward (trainer/models/llama.py, vit.py);
- Hugging Face models go through transformers' attention registry (`AttentionInterface`):
  trainer/models/hf.py registers a function that calls the module's `attend`;
- modules that call `F.scaled_dot_product_attention` inside their own forward (timm's) are
  redirected: `redirect_sdpa` sends that call, made inside the module, to its `attend`.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

Attend = Callable[..., torch.Tensor]


def wrap_attend(modules: Sequence[nn.Module], wrap: Callable[[Attend], Attend]) -> int:
    """module.attend = wrap(module.attend) for each module; returns how many."""
    for module in modules:
        module.attend = wrap(module.attend)
    return len(modules)


class _SdpaTo(TorchFunctionMode):
    """Inside it, F.scaled_dot_product_attention(...) is attend(...). While the mode handles a
    call it is off, so an attend that calls F.scaled_dot_product_attention itself reaches torch."""

    def __init__(self, attend: Attend) -> None:
        super().__init__()
        self.attend = attend

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.attend(*args, **kwargs)
        return func(*args, **kwargs)


def redirect_sdpa(module: nn.Module) -> None:
    """Make `module` call its `attend` where its forward calls F.scaled_dot_product_attention
    (attend starts as that function itself, so nothing changes until it is wrapped). Once per
    module; the module's forward becomes an instance attribute."""
    if "attend" in vars(module):
        return
    module.attend = F.scaled_dot_product_attention
    forward = module.forward

    def redirected(*args, **kwargs):
        with _SdpaTo(module.attend):
            return forward(*args, **kwargs)

    module.forward = redirected
