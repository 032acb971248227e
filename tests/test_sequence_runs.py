"""sharding.sequence and checkpointing.tiles through the trainer (issue 38): the Trainer built as
a run builds it (mesh, sequence group, tiles, the Data's slices), one step's loss and gradients
and the validation loss against N=1 / untiled, on 2 gloo ranks (one spawn for every case) and
N=2 x fsdp 2 on 4 (one spawn); resume N=2 -> N=1 from the command line.

Attention dropout is 0 in every comparison across degrees: a rank attends with other heads than
it would alone, so it cannot draw N=1's masks (trainer/models/sequence_parallel.py); the
built-in Llama's one `model.dropout` drives its attention dropout too, so it is 0 there. The
tiled-vs-untiled cases at one degree keep dropout on (tiles replay their random state).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist import spawn
from tests.helpers import QUICK, check_ok, config, losses, read_metrics, run_trainer

HF_LLAMA = ("model.hf_config={model_type: llama, vocab_size: 300, hidden_size: 64, "
            "intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, "
            "num_key_value_heads: 2, max_position_embeddings: 128}")
TOLERANCE = 1e-6  # relative: the largest gradient difference over the largest gradient


def chat(work: Path) -> list[str]:
    """Packed chat data (document masks), a local ChatML tokenizer, 64-token windows."""
    return ["data=chat", f"data.path={work / 'chats.jsonl'}", f"data.tokenizer={work / 'tok'}",
            "model.vocab_size=300", f"data.cache_dir={work / 'cache'}", "data.seq_len=64",
            "data.val_fraction=0.2", "logging.wandb=false", "logging.progress=false",
            "train.global_batch_size=4"]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    from trainer.data.demo import chat_records, make_tokenizer, write_jsonl

    folder = tmp_path_factory.mktemp("sequence_runs")
    make_tokenizer(folder / "tok")
    write_jsonl(folder / "chats.jsonl", chat_records(120))
    return folder


def _one_step(overrides: list[str], run_dir: str) -> dict:
    """The Trainer of this command line on this rank; its first step's loss and full
    gradients (the optimizer held still), and its validation loss."""
    from checkpointing.blocks import canonical_name
    from trainer.distenv import read_env
    from trainer.loop import Trainer, _to, train_step
    from trainer.observe.evaluate import evaluate
    from trainer.validate import validate

    cfg = config(*overrides, f"train.out_dir={run_dir}")
    layout = validate(cfg, world_size=dist.get_world_size())
    denv = read_env("cpu")
    os.makedirs(run_dir, exist_ok=True)
    torch.manual_seed(cfg.train.seed + denv.rank)  # as trainer.loop.train seeds dropout
    trainer = Trainer(cfg, layout, run_dir, denv)
    try:
        optimizer = trainer.model_state.optimizer
        optimizer.step = lambda *args, **kwargs: None  # keep the gradients, and the weights
        optimizer.zero_grad = lambda *args, **kwargs: None
        batch, counts = trainer.data.batch(0)
        loss, _, _, _ = train_step(trainer.step_parts, _to(batch, denv.device),
                                   trainer.task.loss, counts and counts[0])
        model = trainer.model_state.model
        grads = {canonical_name(n): p.grad.full_tensor() for n, p in model.named_parameters()}
        val = evaluate(model, trainer.data.val, trainer.task, denv.device)["val_loss"]
        tiled = sum(getattr(m, "_blocktrain_tiles", 1) > 1 for m in model.modules())
        return {"loss": loss, "val": val, "grads": grads, "tiled": tiled,
                "slice": tuple(batch[0][0].shape), "plan": [p.tiles for p in trainer.built.plan]}
    finally:
        trainer.closing.close()


def _worst(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(((got[n] - want[n]).abs().max() / want[n].abs().max().clamp(min=1e-30)).item()
               for n in want)


def _compare(pairs: dict, work: str, rank: int) -> dict:
    """For each case, (the run, its reference) -> loss, val loss and the gradient error."""
    out = {}
    for name, (run, reference) in pairs.items():
        got = _one_step(run, os.path.join(work, name, "run"))
        want = _one_step(reference, os.path.join(work, name, "reference"))
        out[name] = {"loss": (got["loss"], want["loss"]), "val": (got["val"], want["val"]),
                     "grad_error": _worst(got["grads"], want["grads"]), "tiled": got["tiled"],
                     "slice": got["slice"], "plan": got["plan"]}
    return out


def _stream_counts(rank: int, world: int) -> dict:
    """A stream's counts summed over a sequence group of 2: each sample once."""
    import numpy as np

    from tests.helpers import sampling
    from trainer.data.batches import StreamedData
    from trainer.data.tokens import WindowDataset
    from trainer.faults import TimeoutWatchdog

    class Stream:
        def read(self, step):
            row = torch.arange(8).view(1, 8)
            return [(row, row + 1, row)], (5, 8)  # this group's windows' counts

    data = StreamedData(Stream(), WindowDataset(np.arange(100), 8),
                        sampling(rank, world, 1, 1, sequence=world), 0,
                        torch.device("cpu"), TimeoutWatchdog(rank, 60))
    try:
        batches, counts = data.batch(0)
        return {"counts": counts, "inputs": batches[0][0].tolist(),
                "val": data.val[0][0].tolist()}
    finally:
        data.close()


def _two_ranks(rank: int, world: int, work: str) -> dict:
    base = chat(Path(work))
    # The same 4 samples a step, and the same 4 validation samples (eval_batches x micro x groups).
    n1 = ["train.micro_batch_size=2", "train.eval_batches=1"]
    n2 = ["train.micro_batch_size=1", "sharding.sequence=2", "train.eval_batches=4"]
    chunked = ["checkpointing.head=chunked", "checkpointing.head_chunk_tokens=16"]
    llama, hf = [*base, "model.dropout=0.0"], [*base, "model=hf", HF_LLAMA]
    dropout = [*base, "model.dropout=0.1"]
    qwen3 = [*base, "model=qwen3_tiny", "model.dropout=0.0"]
    # A mean loss (token windows, no packing): each slice's mean, averaged over the ranks.
    tokens = ["data=synthetic", "data.seq_len=64", "model.dropout=0.0",
              "data.val_fraction=0.2", "logging.wandb=false", "logging.progress=false",
            "train.global_batch_size=4"]
    pairs = {
        "synthetic": ([*tokens, *n2], [*tokens, *n1]),
        "synthetic-chunked": ([*tokens, *n2, *chunked], [*tokens, *n1, *chunked]),
        "llama": ([*llama, *n2, *chunked], [*llama, *n1, *chunked]),
        "hf": ([*hf, *n2, *chunked], [*hf, *n1, *chunked]),
        "hf-plain-selective": ([*hf, *n2, "checkpointing=selective"], [*hf, *n1]),
        "tiles-none": ([*dropout, *n1, "checkpointing.tiles=4"], [*dropout, *n1]),
        "tiles-full": ([*dropout, *n1, "checkpointing=full", "checkpointing.tiles=3",
                        *chunked], [*dropout, *n1, *chunked]),
        "tiles-selective-disk": ([*dropout, *n1, "checkpointing=selective", "offload=disk",
                                  "offload.min_bytes=0", "offload.keep_last=0",
                                  "checkpointing.tiles=2"], [*dropout, *n1]),
        "hf-tiles-sequence": ([*hf, *n2, "checkpointing=full", "checkpointing.tiles=2",
                               *chunked], [*hf, *n1, *chunked]),
        "compiled-tiles-sequence": ([*llama, *n2, "checkpointing.tiles=2", "train.compile=true",
                                     "train.compile_backend=aot_eager"], [*llama, *n1]),
        # Qwen3 (q/k norms, heads wider than dim / n_heads, tied): sequence x tiles x chunked.
        "qwen3-tiles-sequence": ([*qwen3, *n2, "checkpointing=full", "checkpointing.tiles=2",
                                  *chunked], [*qwen3, *n1, *chunked]),
        "compiler-tiles": ([*llama, *n1, "checkpointing=compiler", "checkpointing.budget=0.5",
                            "train.compile=true", "train.compile_backend=aot_eager",
                            "checkpointing.tiles=2"], [*llama, *n1]),
    }
    out = _compare(pairs, work, rank)
    out["stream"] = _stream_counts(rank, world)
    return out


def _four_ranks(rank: int, world: int, work: str) -> dict:
    llama = [*chat(Path(work)), "model.dropout=0.0", "checkpointing.head=chunked",
             "checkpointing.head_chunk_tokens=16", "checkpointing=full", "train.eval_batches=1"]
    n2 = [*llama, "train.micro_batch_size=2", "sharding.sequence=2"]
    reference = [*llama, "train.micro_batch_size=1"]
    # hsdp: 2 replicas x (1 data x 2 sequence ranks): the sequence axis inside each replica.
    return _compare({"llama-2x2": (n2, reference),
                     "llama-hsdp": ([*n2, "sharding=hsdp", "sharding.replicate=2"], reference)},
                    work, rank)


@pytest.fixture(scope="module")
def two_ranks(work) -> list[dict]:
    return spawn(_two_ranks, 2, str(work))


CASES = ("synthetic", "synthetic-chunked", "llama", "hf", "hf-plain-selective", "tiles-none", "tiles-full", "tiles-selective-disk",
         "hf-tiles-sequence", "compiled-tiles-sequence", "compiler-tiles", "qwen3-tiles-sequence")


@pytest.mark.parametrize("name", CASES)
def test_one_step_matches_the_reference_loss_gradients_and_val_loss(two_ranks, name) -> None:
    for rank in two_ranks:
        got = rank[name]
        assert got["loss"][0] == pytest.approx(got["loss"][1], rel=TOLERANCE, abs=0), name
        assert got["val"][0] == pytest.approx(got["val"][1], rel=TOLERANCE, abs=0), name
        assert got["grad_error"] < TOLERANCE, (name, got["grad_error"])


def test_each_rank_holds_its_slice_and_the_plan_its_tiles(two_ranks) -> None:
    rank = two_ranks[0]
    assert rank["llama"]["slice"] == (1, 32)  # a 64-token window, half of it per rank
    assert rank["tiles-none"]["slice"] == (2, 64)
    # tiny: 4 blocks of 7 modules in tiles (both norms, wq/wk/wv, the MLP, the attention's query
    # tiles), and the final norm
    assert rank["tiles-full"]["plan"] == [3] * 4 and rank["tiles-full"]["tiled"] == 4 * 7 + 1
    assert rank["hf-tiles-sequence"]["plan"] == [2] * 2 and rank["hf-tiles-sequence"]["tiled"] == 2
    assert rank["llama"]["plan"] == [1] * 4 and rank["llama"]["tiled"] == 0


def test_a_stream_counts_a_sequence_groups_samples_once(two_ranks) -> None:
    for place, rank in enumerate(two_ranks):
        stream = rank["stream"]
        assert stream["counts"] == (5, 8)  # not (10, 16): both ranks read the same windows
        assert stream["inputs"] == [list(range(4 * place, 4 * place + 4))]
        assert len(stream["val"][0]) == 4  # validation is sliced alike


def test_sequence_2_by_fsdp_2_and_by_hsdp_2_on_four_ranks(work) -> None:
    ranks = spawn(_four_ranks, 4, str(work))
    for name in ("llama-2x2", "llama-hsdp"):
        got = ranks[0][name]
        assert got["loss"][0] == pytest.approx(got["loss"][1], rel=TOLERANCE, abs=0), name
        assert got["val"][0] == pytest.approx(got["val"][1], rel=TOLERANCE, abs=0), name
        assert got["grad_error"] < TOLERANCE, (name, got["grad_error"])
        assert got["slice"] == (2, 32), name  # micro-batches of 2 samples, half of each


def test_a_run_saved_at_sequence_2_resumes_at_1(work, tmp_path) -> None:
    """Steps 3-4 of a run saved at step 2 with sharding.sequence=2 and resumed with 1 (same
    samples: the global batch fixed) are those of the run that never stopped."""
    run = [*QUICK, *chat(work), "model.dropout=0.0", "train.steps=4", "save.every=2",
           "train.micro_batch_size=1", "optim.lr=3e-3"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    at_2 = ["sharding.sequence=2", "train.eval_batches=4"]  # 4 validation samples, as at 1
    check_ok(run_trainer([*run, *at_2, f"hydra.run.dir={whole}"], tmp_path, nproc=2))
    stopped = run_trainer([*run, *at_2, "train.stop_at_step=2", f"hydra.run.dir={split}"],
                          tmp_path, nproc=2)
    assert "stopping (train.stop_at_step): saved step 2" in stopped.stderr + stopped.stdout
    check_ok(run_trainer([*run, "train.micro_batch_size=2", "train.eval_batches=1",
                          f"hydra.run.dir={split}"], tmp_path, nproc=2))
    assert losses(split) == pytest.approx(losses(whole), rel=TOLERANCE, abs=0)
    assert len(losses(split)) == 4
    log = (split / "train.log").read_text()
    assert "sharding.sequence=2->1" in log and "resumed from" in log
    evaluated = [m["val_loss"] for m in read_metrics(split) if "val_loss" in m]
    assert evaluated == pytest.approx([m["val_loss"] for m in read_metrics(whole)
                                       if "val_loss" in m], rel=TOLERANCE, abs=0)
