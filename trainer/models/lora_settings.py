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
