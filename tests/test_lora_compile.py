"""LoRA with train.compile=true (inductor on CPU, as tests/test_compile.py): compiled blocks
holding PEFT's adapted layers train like eager ones (within 1e-4, the tolerance
tests/test_checkpointing_cli.py gives compiled vs eager), and every policy compiled gives
bitwise the losses and adapter gradients of compiled `none`, dropout on (the bitwise
claim tests/test_compile.py makes without LoRA)."""

from __future__ import annotations

import pytest
import torch

from checkpointing.meter import SavedBytesMeter
from tests.checkpoint_harness import SMALL, train_steps
from tests.helpers import config, layout_of
from trainer.build import build_model
from trainer.distenv import read_env

LORA = ["model=tiny", "model.lora.rank=4", "model.lora.alpha=8", "model.lora.dropout=0.1",
        "optim.lr=1e-2"]


def _steps(run_dir: str, *overrides: str):
    cfg = config(*SMALL, *LORA, *overrides)
    torch.manual_seed(7)  # the dropout masks: the same for every run
    built = build_model(cfg, read_env("cpu"), layout=layout_of(cfg), meter=SavedBytesMeter(),
                        run_dir=run_dir)
    assert built.compiled_blocks == (4 if cfg.train.compile else 0)
    losses, grads, _ = train_steps(built, SavedBytesMeter(), cfg.optim, 3, 0)
    return losses, {name: grad for name, grad in grads.items() if grad is not None}


@pytest.mark.slow
def test_lora_compiled_trains_like_eager_and_every_policy_is_bitwise(world_of_one,
                                                                      tmp_path) -> None:
    # Without dropout (inductor draws its masks otherwise than eager).
    plain = ["checkpointing=none", "model.dropout=0", "model.lora.dropout=0"]
    eager = _steps(str(tmp_path), *plain)
    compiled_plain = _steps(str(tmp_path), *plain, "train.compile=true")
    torch.testing.assert_close(compiled_plain[0], eager[0], rtol=0, atol=1e-4)
    assert not torch.equal(eager[0][0], eager[0][-1])  # the adapters moved the loss
    assert compiled_plain[1] and all(".lora_" in name for name in compiled_plain[1])
    reference = _steps(str(tmp_path), "checkpointing=none", "train.compile=true")
    for policy in ("full", "selective", "every_k"):
        losses, grads = _steps(str(tmp_path), f"checkpointing={policy}", "train.compile=true")
        assert torch.equal(losses, reference[0]), policy
        assert grads.keys() == reference[1].keys(), policy
        assert all(torch.equal(grads[n], reference[1][n]) for n in grads), policy
