"""The block's linear layers as the step's FLOPs need them, beside torch's FLOP counter.

- Frozen linears (a LoRA base: its weight without requires_grad) compute no weight gradient: their
  backward is one matmul (the input's gradient), not two. Their forward FLOPs are summed here
  so that step_time.py counts them once in backward.
- A layer that computes on meta without a matmul the counter could see (a 4-bit NF4 linear,
  trainer/models/families/qlora.py, returns an empty output there) says what its real forward
  costs through `meta_linear_flops(x)`; those FLOPs are added, and are frozen ones.
"""

from __future__ import annotations

from torch import nn


def matmul_flops(x, in_features: int, out_features: int) -> int:
    """A linear layer's forward FLOPs on input `x` (its last dim in_features)."""
    return 2 * (x.numel() // in_features) * in_features * out_features


class LinearFlops:
    """Forward hooks on `block`'s linears while inside `with`: `.unseen` and `.frozen` FLOPs."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block
        self.unseen = 0
        self.frozen = 0
        self._handles: list = []

    def _count(self, module: nn.Module, args: tuple, output) -> None:
        unseen = getattr(module, "meta_linear_flops", None)
        if unseen is not None:
            flops = unseen(args[0])
            self.unseen += flops
            self.frozen += flops
        elif not module.weight.requires_grad:
            self.frozen += matmul_flops(args[0], module.in_features, module.out_features)

    def __enter__(self) -> "LinearFlops":
        for module in self.block.modules():
            if isinstance(module, nn.Linear) or hasattr(module, "meta_linear_flops"):
                self._handles.append(module.register_forward_hook(self._count))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
