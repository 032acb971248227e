"""model.lora: the settings of low-rank adapters (trainer/models/lora.py applies them).

Nothing here imports torch or the rest of the trainer: trainer/config.py composes it into the
schema, and trainer/validate.py checks its values before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

# The families whose models take adapters: language models (LoRA targets their linear layers).
LORA_ARCHS = ("hf", "llama", "qwen3")
QUANTIZE = ("none", "nf4")


@dataclass
class LoraSettings:
    """Low-rank adapters (LoRA, through PEFT: trainer/models/lora.py) on a frozen base. Off
    while rank is null; on, only the adapters train (gradients, optimizer state, reduce-scatters)."""

    rank: Optional[int] = None  # r of each adapter; null: no LoRA, every weight trains
    alpha: float = 16.0  # the adapter's update is scaled by alpha / rank (PEFT's lora_alpha)
    dropout: float = 0.0  # on the adapter's input (PEFT's lora_dropout)
    # Module-name globs of the linear layers that get adapters, as the model names them (e.g.
    # "*.q_proj", "layers.*.attention.wq"); empty: every linear layer inside the blocks.
    targets: List[str] = field(default_factory=list)
    # none | nf4: the frozen base's block linears stored in 4-bit NF4 (QLoRA, torchao's
    # NF4Tensor), dequantized per block inside the plan's unit.
    quantize: str = "none"

    @property
    def on(self) -> bool:
        return self.rank is not None

    def identity(self) -> dict:
        """What a checkpoint records and a resume must match (trainer/state/resume.py)."""
        return {"rank": self.rank, "alpha": float(self.alpha), "dropout": float(self.dropout),
                "targets": list(self.targets), "quantize": self.quantize}


def lora_changes(saved: Optional[dict], now: Optional[dict]) -> list[str]:
    """`model.lora.<key> <saved> -> <now>` for each LoRA setting a resume would change (dicts
    as dataclasses.asdict writes them; a checkpoint from before model.lora existed: off)."""
    was, is_ = dict(LoraSettings().__dict__), dict(LoraSettings().__dict__)
    was.update(saved or {})
    is_.update(now or {})
    return [f"model.lora.{key} {was[key]!r} -> {is_[key]!r}" for key in sorted(is_)
            if was.get(key) != is_[key]]
