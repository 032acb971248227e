"""What `sharding.reshard_after_forward` does, measured on 2 ranks (the evidence README's
"Sharding" section quotes): which parameters are freed after forward, how many all-gathers a
step makes, the peak of live tensor bytes, and that the losses do not change.

    pytest tests/test_reshard.py -s   # prints the figures
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from checkpointing.meter import SavedBytesMeter
from tests.dist import spawn
from tests.helpers import config, layout_of
from trainer.build import build_model
from trainer.distenv import read_env
from trainer.observe.livebytes import LiveTensorBytes
from trainer.models.llama import lm_loss

LAYERS = 4
MODEL = ["model=tiny", f"model.n_layers={LAYERS}", "model.vocab_size=4096", "model.dim=256",
         "model.ffn_hidden=768", "data.seq_len=128", "train.micro_batch_size=4",
         "checkpointing=none"]


def _measure(rank: int, world_size: int, reshard: bool) -> dict:
    cfg = config(*MODEL, f"sharding.reshard_after_forward={str(reshard).lower()}")
    model = build_model(cfg, read_env("cpu"), layout=layout_of(cfg), meter=SavedBytesMeter()).model
    gathered: list[int] = []
    all_gather = dist.all_gather_single  # what FSDP2's default all-gather calls

    def counting(output, *args, **kwargs):
        gathered.append(output.numel() * output.element_size())
        return all_gather(output, *args, **kwargs)

    tokens = torch.randint(0, 4096, (4, 129), generator=torch.Generator().manual_seed(rank))
    dist.all_gather_single = counting
    try:
        losses, figures = [], {}
        for step in range(3):
            gathered.clear()
            live = LiveTensorBytes([*model.parameters(), tokens]) if step == 1 else None
            with live or torch.enable_grad():
                loss = lm_loss(model, tokens[:, :-1], tokens[:, 1:])
                after_forward = {"root": isinstance(model.tok_embeddings.weight, DTensor),
                                 "first": isinstance(model.layers[0].attention.wq.weight, DTensor),
                                 "last": isinstance(model.layers[-1].attention.wq.weight, DTensor)}
                loss.backward()
            if live is not None:
                figures = {"peak": live.peak, "gathers": len(gathered), "bytes": sum(gathered),
                           "resharded": after_forward}
            for param in model.parameters():
                param.grad = None
            losses.append(loss.detach())
    finally:
        dist.all_gather_single = all_gather
    return {**figures, "losses": torch.stack(losses)}


@pytest.mark.slow
def test_reshard_after_forward_frees_blocks_but_the_last_and_the_losses_hold() -> None:
    runs = {flag: spawn(_measure, 2, flag)[0] for flag in (True, False)}
    for flag, r in runs.items():
        print(f"reshard_after_forward={flag}: {r['gathers']} all-gathers a step "
              f"({r['bytes'] / 2**20:.1f} MiB per rank), peak live tensors "
              f"{r['peak'] / 2**20:.1f} MiB, resharded after forward {r['resharded']}")
    on, off = runs[True], runs[False]
    # true: every block but the last is freed after forward and gathered again in backward; so is
    # the root (torch 2.13 reshards it when told to). Keeping the last block costs no peak: its
    # backward comes first. false: nothing is freed, each group is gathered once.
    assert on["resharded"] == {"root": True, "first": True, "last": False}
    assert off["resharded"] == {"root": False, "first": False, "last": False}
    assert on["gathers"] == 2 * (LAYERS + 1) - 1 and off["gathers"] == LAYERS + 1
    assert on["peak"] < off["peak"]
    assert torch.equal(on["losses"], off["losses"])
