"""sharding.context through the trainer (issue 45): the Trainer built as a run builds it (the
(data, context, sequence) mesh, the ring, the Data's balanced shares), one step's loss, gradients
and validation loss against one rank per sample; every checkpointing policy bit for bit against
none under context=2; sequence=2 x context=2 on 4 ranks; bad settings refused naming the key.

Attention dropout is 0 throughout: the ring has none (model.dropout>0 is refused with context),
and the built-in Llama's one model.dropout drives it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist import spawn
from tests.helpers import config
from tests.test_sequence_runs import HF_LLAMA, _compare, chat
from trainer.config import ConfigError
from trainer.validate import validate

TOLERANCE = 1e-5  # the softmax merge reorders sums
ONE = ["train.micro_batch_size=2", "train.eval_batches=1"]  # 2 ranks, each its own samples
RING = ["train.micro_batch_size=1", "sharding.context=2", "train.eval_batches=4"]
CHUNKED = ["checkpointing.head=chunked", "checkpointing.head_chunk_tokens=16"]
POLICIES = (["checkpointing=full"], ["checkpointing=every_k"], ["checkpointing=sqrt"],
            ["checkpointing=selective"], ["checkpointing=budget", "checkpointing.budget=0.6"],
            ["checkpointing=full", "offload=cpu", "offload.min_bytes=0"])


def _name(policy: list[str]) -> str:
    """A case name that is also a folder name Hydra parses: policy-budget-0.45."""
    return "policy-" + "-".join(p.split("=")[1] for p in policy)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    from trainer.data.demo import chat_records, make_tokenizer, write_jsonl

    folder = tmp_path_factory.mktemp("ring_runs")
    make_tokenizer(folder / "tok")
    write_jsonl(folder / "chats.jsonl", chat_records(120))
    return folder


def _two_ranks(rank: int, world: int, work: str) -> dict:
    llama = [*chat(Path(work)), "model.dropout=0.0"]
    qwen3 = [*llama, "model=qwen3_tiny", "model.dropout=0.0"]
    hf = [*chat(Path(work)), "model=hf", HF_LLAMA]
    tokens = ["data=synthetic", "data.seq_len=64", "model.dropout=0.0", "data.val_fraction=0.2",
              "logging.wandb=false", "logging.progress=false", "train.global_batch_size=4"]
    pairs = {"packed-chunked": ([*llama, *RING, *CHUNKED], [*llama, *ONE, *CHUNKED]),
             "packed-plain": ([*llama, *RING], [*llama, *ONE]),
             "tokens-mean": ([*tokens, *RING], [*tokens, *ONE]),
             "hf-packed-chunked": ([*hf, *RING, *CHUNKED], [*hf, *ONE, *CHUNKED]),
             # torch.compile of each block (aot_eager here) with the ring inside
             "compiled-full": ([*llama, *RING, "checkpointing=full", "train.compile=true",
                                "train.compile_backend=aot_eager"], [*llama, *ONE]),
             "qwen3-tiles-full": ([*qwen3, *RING, "checkpointing=full", "checkpointing.tiles=2",
                                   *CHUNKED], [*qwen3, *ONE, *CHUNKED])}
    for policy in POLICIES:  # against context=2 without checkpointing: bit for bit
        pairs[_name(policy)] = ([*llama, *RING, *CHUNKED, *policy],
                                               [*llama, *RING, *CHUNKED])
    return _compare(pairs, work, rank)


@pytest.fixture(scope="module")
def two_ranks(work) -> list[dict]:
    return spawn(_two_ranks, 2, str(work))


@pytest.mark.parametrize("name", ["packed-chunked", "packed-plain", "tokens-mean",
                                  "hf-packed-chunked", "qwen3-tiles-full", "compiled-full"])
def test_context_2_matches_one_rank_per_sample(two_ranks, name) -> None:
    for rank in two_ranks:
        got = rank[name]
        assert got["loss"][0] == pytest.approx(got["loss"][1], rel=TOLERANCE, abs=0), name
        assert got["val"][0] == pytest.approx(got["val"][1], rel=TOLERANCE, abs=0), name
        assert got["grad_error"] < TOLERANCE, (name, got["grad_error"])
        assert got["slice"] == (1, 32), name  # a 64-token window, a balanced half per rank


@pytest.mark.parametrize("policy", [" ".join(p) for p in POLICIES])
def test_every_policy_is_bitwise_none_under_context_2(two_ranks, policy) -> None:
    for rank in two_ranks:
        got = rank[_name(policy.split())]
        assert got["loss"][0] == got["loss"][1], policy
        assert got["val"][0] == got["val"][1], policy
        assert got["grad_error"] == 0.0, policy


def _four_ranks(rank: int, world: int, work: str) -> dict:
    llama = [*chat(Path(work)), "model.dropout=0.0", *CHUNKED, "checkpointing=full",
             "train.eval_batches=1"]
    both = [*llama, "train.micro_batch_size=4", "sharding.sequence=2", "sharding.context=2"]
    ring = [*llama, "train.micro_batch_size=2", "sharding.context=2"]
    reference = [*llama, "train.micro_batch_size=1"]
    # hsdp: 2 replicas x (1 data x a ring of 2): the ring inside each replica.
    return _compare({"2x2": (both, reference),
                     "hsdp": ([*ring, "sharding=hsdp", "sharding.replicate=2"], reference)},
                    work, rank)


def test_sequence_2_by_context_2_and_hsdp_rings_on_four_ranks(work) -> None:
    ranks = spawn(_four_ranks, 4, str(work))
    for rank in ranks:
        for name, share in (("2x2", (4, 16)), ("hsdp", (2, 32))):  # samples x their tokens
            got = rank[name]
            assert got["loss"][0] == pytest.approx(got["loss"][1], rel=TOLERANCE, abs=0), name
            assert got["val"][0] == pytest.approx(got["val"][1], rel=TOLERANCE, abs=0), name
            assert got["grad_error"] < TOLERANCE, (name, got["grad_error"])
            assert got["slice"] == share, name


@pytest.mark.parametrize("overrides, world, key, says", [
    (["sharding.context=3"], 4, "sharding.context", "must divide the world size 4"),
    (["sharding.context=2", "sharding.sequence=2"], 2, "sharding.context",
     "sharding.sequence x sharding.context = 4 must divide the world size 2"),
    (["sharding.context=2", "sharding=none"], 2, "sharding.context", "needs sharding=fsdp"),
    (["sharding.context=2", "data.seq_len=34"], 2, "sharding.context",
     "2 x sharding.context x sharding.sequence = 4 must divide data.seq_len=34"),
    (["sharding.context=2", "model.dropout=0.1"], 2, "model.dropout", "no attention dropout"),
    (["sharding.context=2", "model=vit_tiny", "data=synthetic_images"], 2, "sharding.context",
     "model.arch=vit has no ring attention"),
    (["sharding.context=0"], 2, "sharding.context", "must be a positive integer"),
    (["sharding.context=2", "model.attention=math"], 2, "model.attention",
     "math cannot run under sharding.context=2"),
    (["sharding.context=2", "model=hf", HF_LLAMA[:-1] + ", attention_dropout: 0.1}"], 2,
     "model.hf_config", "attention_dropout=0.1: ring attention"),
    (["sharding.context=2", "model=hf", HF_LLAMA, "model.attn_implementation=flex_attention"],
     2, "model.attn_implementation", "'flex_attention' cannot run through the ring"),
])
def test_bad_context_settings_name_the_key(overrides, world, key, says) -> None:
    cfg = config("model.dropout=0.0", "data.seq_len=64", *overrides)
    with pytest.raises(ConfigError, match=f"^{key}: .*{says}"):
        validate(cfg, world_size=world)


def test_context_2_halves_the_data_groups() -> None:
    layout = validate(config("model.dropout=0.0", "data.seq_len=64", "sharding.context=2",
                             "sharding.sequence=2", "train.global_batch_size=4",
                             "train.micro_batch_size=1"), world_size=8)
    assert (layout.share, layout.data_size, layout.grad_accum) == (4, 2, 2)
    assert [(layout.data_rank(r), layout.context_rank(r), layout.sequence_rank(r))
            for r in range(8)] == [(r // 4, (r // 2) % 2, r % 2) for r in range(8)]


def test_a_run_resumes_across_degrees_and_world_sizes(work, tmp_path) -> None:
    """A run saved at step 2 with context=2 on 2 ranks, resumed at sequence=2 (2 ranks) to
    step 3, then on 1 rank to step 4: the losses and validation losses of the run that never
    stopped (the global batch fixed: the same samples)."""
    from tests.helpers import QUICK, check_ok, losses, read_metrics, run_trainer

    run = [*QUICK, *chat(work), "model.dropout=0.0", "train.steps=4", "save.every=2",
           "optim.lr=3e-3"]
    ring = ["sharding.context=2", "train.micro_batch_size=1", "train.eval_batches=4"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    check_ok(run_trainer([*run, *ring, f"hydra.run.dir={whole}"], tmp_path, nproc=2))
    for step, degrees in ((2, ring), (3, ["sharding.sequence=2", "train.micro_batch_size=1",
                                          "train.eval_batches=4"])):
        stopped = run_trainer([*run, *degrees, f"train.stop_at_step={step}",
                               f"hydra.run.dir={split}"], tmp_path, nproc=2)
        said = stopped.stderr + stopped.stdout
        assert f"stopping (train.stop_at_step): saved step {step}" in said, said[-3000:]
    check_ok(run_trainer([*run, "train.micro_batch_size=4", "train.eval_batches=1",
                          f"hydra.run.dir={split}"], tmp_path, nproc=1))
    assert len(losses(split)) == 4
    assert losses(split) == pytest.approx(losses(whole), rel=TOLERANCE, abs=0)
    log = (split / "train.log").read_text()
    assert "sharding.context=2->1" in log and "sharding.sequence=1->2" in log
    assert "saved by 2 ranks, resumed on 1" in log
    evaluated = [m["val_loss"] for m in read_metrics(split) if "val_loss" in m]
    assert evaluated == pytest.approx([m["val_loss"] for m in read_metrics(whole)
                                       if "val_loss" in m], rel=TOLERANCE, abs=0)
