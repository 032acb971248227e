"""checkpointing.head=chunked in whole runs (issue 26): the same training as the plain head, for
the built-in Llama (tied and untied) and an HF Llama; on 2 ranks as on one; FSDP gathers and
reduces the head's weight once per micro-batch, never per chunk; under torch.compile and
checkpointing=compiler; the report sees the head's memory go; bad settings are one line. The op
itself is proven in tests/test_chunked_head.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from checkpointing.meter import SavedBytesMeter
from tests.dist import spawn
from tests.helpers import QUICK, check_ok, config, losses, run_trainer, layout_of
from trainer.build import build_model
from trainer.config import ConfigError
from trainer.distenv import read_env
from trainer.preflight.precheck import deep_check
from trainer.task import task_for

BIG_VOCAB = ["model.vocab_size=2048", "data=synthetic", "model.dropout=0.0"]
HF_LLAMA = ["model=hf", "model.hf_config={model_type: llama, vocab_size: 2048, hidden_size: 64, "
            "intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, "
            "num_key_value_heads: 2}"]


@pytest.mark.parametrize("model", [["model.tie_embeddings=false"], ["model.tie_embeddings=true"],
                                   HF_LLAMA], ids=["untied", "tied", "hf-llama"])
def test_fifty_steps_chunked_match_the_plain_head(model, tmp_path) -> None:
    # Bytes of real text (a loss that falls), a vocabulary of 2048 (the head's share grows).
    run = [*QUICK, "model.vocab_size=2048", "model.dropout=0.0", *model, "train.steps=50",
           "train.eval_every=25", "data.seq_len=32", "train.micro_batch_size=2", "optim.lr=1e-3"]
    for head in ("plain", "chunked"):
        check_ok(run_trainer([*run, f"checkpointing.head={head}", "checkpointing.head_chunk_tokens=50",
                              f"hydra.run.dir={tmp_path / head}"], tmp_path))
    plain, chunked = losses(tmp_path / "plain"), losses(tmp_path / "chunked")
    assert len(plain) == 50 and plain[-1] < plain[0] - 0.5
    assert chunked == pytest.approx(plain, rel=1e-5)


def _head_traffic(rank: int, world: int, head: str, accum: int) -> dict:
    """All-gathers and reduce-scatters of a step, and the loss, on 2 ranks."""
    cfg = config(*BIG_VOCAB, "data.seq_len=64", "train.micro_batch_size=2",
                 f"checkpointing.head={head}", "checkpointing.head_chunk_tokens=16")
    model = build_model(cfg, read_env("cpu"), layout=layout_of(cfg), meter=SavedBytesMeter()).model
    task = task_for(cfg.model, cfg.data, cfg.checkpointing)
    counts = {"gather": 0, "reduce": 0}
    gather, reduce = dist.all_gather_single, dist.reduce_scatter_tensor

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return call

    tokens = torch.randint(0, 2048, (accum, 2, 65), generator=torch.Generator().manual_seed(rank))
    dist.all_gather_single = counted("gather", gather)
    dist.reduce_scatter_tensor = counted("reduce", reduce)
    try:
        total = 0.0
        for micro in tokens:
            loss = task.loss(model, micro[:, :-1], micro[:, 1:]) / accum
            loss.backward()
            total += loss.item()
    finally:
        dist.all_gather_single, dist.reduce_scatter_tensor = gather, reduce
    grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
    return {**counts, "loss": total, "grads": grads}


@pytest.mark.parametrize("accum", [1, 2])
def test_fsdp_gathers_and_reduces_the_head_once_per_micro_batch(accum) -> None:
    """The chunked head runs inside the root's forward, where FSDP has gathered its weight once:
    a chunk costs no collective. Gradients match the plain head's on 2 ranks."""
    plain = spawn(_head_traffic, 2, "plain", accum)[0]
    chunked = spawn(_head_traffic, 2, "chunked", accum)[0]  # 128 tokens: 8 chunks a micro-batch
    assert (chunked["gather"], chunked["reduce"]) == (plain["gather"], plain["reduce"])
    assert chunked["loss"] == pytest.approx(plain["loss"], rel=1e-6)
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(chunked["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("extra", [["train.compile=true", "train.compile_backend=aot_eager"],
                                   ["checkpointing=compiler", "train.compile_backend=aot_eager"]],
                         ids=["compile", "compiler"])
def test_the_chunked_head_runs_compiled(extra, tmp_path) -> None:
    run = [*QUICK, *BIG_VOCAB, "train.steps=4", *extra, f"hydra.run.dir={tmp_path / 'run'}"]
    check_ok(run_trainer([*run, "checkpointing.head=chunked", "checkpointing.head_chunk_tokens=64"],
                         tmp_path))
    assert len(losses(tmp_path / "run")) == 4


def test_the_report_sees_the_head_go(tmp_path) -> None:
    from trainer.preflight.scenario import Evaluator, Scenario
    from trainer.cli import check

    peaks = {}
    for head in ("plain", "chunked"):
        cfg, layout = check(["model=llama_8b", "data=synthetic", "data.seq_len=8192",
                             "train.micro_batch_size=1", "checkpointing=full",
                             f"checkpointing.head={head}"], {"WORLD_SIZE": "8"})
        outcome = Evaluator(400.0).evaluate(Scenario(cfg, layout, 8))
        peaks[head] = outcome.estimate.peak
    assert peaks["plain"].name.startswith("the head")  # the logits set the peak today
    assert not peaks["chunked"].name.startswith("the head")
    assert peaks["chunked"].total < peaks["plain"].total - 5 * 2**30


@pytest.mark.parametrize("override, says", [
    ("checkpointing.head_chunk_tokens=0", "checkpointing.head_chunk_tokens: must be null"),
    ("checkpointing.head_budget_mib=0", "checkpointing.head_budget_mib: must be > 0"),
])
def test_bad_head_settings_are_one_line(override, says) -> None:
    from trainer.cli import check

    with pytest.raises(ConfigError, match=says):
        check(["checkpointing.head=chunked", override], {})


def test_a_head_the_chunked_loss_cannot_take_is_refused() -> None:
    gemma = ["model=hf", "model.hf_config={model_type: gemma2, vocab_size: 512, hidden_size: 64, "
             "intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, "
             "num_key_value_heads: 2, head_dim: 16}", "model.attn_implementation=eager",
             "data=synthetic", "checkpointing.head=chunked"]
    with pytest.raises(ConfigError, match="checkpointing.head: .*final_logit_softcapping"):
        deep_check(config(*gemma))
    deep_check(config(*gemma[:-1]))  # the plain head takes it
