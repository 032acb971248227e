"""checkpointing.head_rows=supervised: the head (plain or chunked) runs on the supervised rows
only, and gives today's loss and gradients: every block's gradient and every row's logits bit for
bit, the loss and the head's own weight gradients (summed over fewer rows, in another grouping)
within RELATIVE (norm-wise), for the built-in Llama and an HF Llama, packed and unpacked, a batch
with no supervised row, compiled blocks, every checkpointing policy, and sequence slices over 2
gloo ranks (one spawn)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from checkpointing.head import ROW_MULTIPLE, supervised_rows
from tests.dist import spawn
from tests.helpers import config, layout_of
from trainer.config import CheckpointingConfig, ModelConfig
from trainer.models.families import family_named
from trainer.models.llama import IGNORE_INDEX, LlamaArgs, build_llama

RELATIVE = 1e-6  # |a - b| / |a| of the loss and of each head weight's gradient
BATCH, SEQ, VOCAB, DIM = 4, 32, 300, 32
POSITIONS = torch.tensor([list(range(10)) + list(range(22))] * BATCH)  # two documents per row


def _model(arch: str):
    torch.manual_seed(0)  # every copy: the same weights
    if arch == "llama":
        return build_llama(LlamaArgs(dim=DIM, n_layers=2, n_heads=4, n_kv_heads=2,
                                     vocab_size=VOCAB, ffn_hidden=48, max_seq_len=SEQ),
                           device="cpu")
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.models.hf import HFCausalLM

    hf_config = AutoConfig.for_model(
        "llama", vocab_size=VOCAB, hidden_size=DIM, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    hf_config._attn_implementation = "sdpa"
    return HFCausalLM(AutoModelForCausalLM.from_config(hf_config))


def _task(arch: str, head: str, rows: str, fraction=None):
    c = CheckpointingConfig(head=head, head_chunk_tokens=16, head_rows=rows,
                            head_supervised_fraction=fraction)
    return family_named(arch).task(ModelConfig(arch=arch), SEQ, True, c)


def _batch(supervised: float, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    targets[torch.rand(BATCH, SEQ, generator=g) >= supervised] = IGNORE_INDEX
    return tokens, targets


def _head_params(arch: str) -> set[str]:
    return ({"norm.weight", "output.weight"} if arch == "llama" else
            {"hf.model.norm.weight", "hf.lm_head.weight"})


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / a.double().norm().clamp_min(1e-30))


def _run(arch, task, tokens, targets, positions):
    model = _model(arch)
    out = model.output if arch == "llama" else model.hf.lm_head
    shapes = []
    out.register_forward_hook(lambda m, a, o: shapes.append(o.shape[:-1].numel()))
    loss = task.loss(model, tokens, targets, positions)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, shapes


@pytest.mark.parametrize("arch", ["llama", "hf"])
@pytest.mark.parametrize("head", ["plain", "chunked"])
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_the_head_on_supervised_rows_gives_the_whole_heads_loss_and_gradients(arch, head,
                                                                              packed) -> None:
    tokens, targets = _batch(0.4)
    positions = POSITIONS if packed else None
    whole = _run(arch, _task(arch, head, "all"), tokens, targets, positions)
    gathered = _run(arch, _task(arch, head, "supervised"), tokens, targets, positions)
    supervised = int((targets != IGNORE_INDEX).sum())
    padded = -(-supervised // ROW_MULTIPLE) * ROW_MULTIPLE
    # The head saw only the supervised rows (plus the padding), where it used to see all.
    if head == "plain":
        assert whole[2] == [BATCH * SEQ] and gathered[2] == [padded] and padded < BATCH * SEQ
    assert _relative(whole[0], gathered[0]) <= RELATIVE
    for name, grad in whole[1].items():
        if name in _head_params(arch):
            assert _relative(grad, gathered[1][name]) <= RELATIVE, name
        else:
            assert torch.equal(grad, gathered[1][name]), name


@pytest.mark.parametrize("head", ["plain", "chunked"])
def test_no_supervised_row_gives_zero_loss_and_zero_gradients(head) -> None:
    tokens, targets = _batch(0.0)
    assert supervised_rows(targets).numel() == 0
    loss, grads, _ = _run("llama", _task("llama", head, "supervised"), tokens, targets, POSITIONS)
    assert loss.item() == 0.0
    assert all(g is None or not g.any() for g in grads.values())


def test_a_fully_supervised_batch_runs_the_head_as_before() -> None:
    tokens, targets = _batch(1.0)
    assert supervised_rows(targets) is None
    whole = _run("llama", _task("llama", "plain", "all"), tokens, targets, POSITIONS)
    same = _run("llama", _task("llama", "plain", "supervised"), tokens, targets, POSITIONS)
    assert torch.equal(whole[0], same[0]) and whole[2] == same[2] == [BATCH * SEQ]
    assert all(torch.equal(g, same[1][n]) for n, g in whole[1].items())


def test_rows_on_meta_stand_for_the_planned_fraction() -> None:
    targets = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    assert supervised_rows(targets, meta_fraction=0.4).shape == (64,)  # 51.2 -> 52 -> 64
    assert supervised_rows(targets, meta_fraction=1.0) is None
    assert _task("llama", "plain", "supervised", 0.4).meta_fraction == 0.4
    assert not family_named("llama").task(ModelConfig(), SEQ, False,
                                          CheckpointingConfig()).gather_rows  # unpacked data


# --- with the trainer's parts: policies, compile --------------------------------------------

def _chat_batch(step: int, rank: int):
    return _batch(0.4, seed=100 * step + rank)


def _policy_steps(overrides: list[str], loss_fn, tmp_path):
    from checkpointing.meter import SavedBytesMeter
    from tests.checkpoint_harness import SMALL, train_steps
    from trainer.build import build_model
    from trainer.distenv import read_env

    cfg = config(*SMALL, f"data.seq_len={SEQ}", f"model.vocab_size={VOCAB}", *overrides)
    meter = SavedBytesMeter()
    torch.manual_seed(7)
    built = build_model(cfg, read_env("cpu"), layout=layout_of(cfg), meter=meter, run_dir=str(tmp_path))
    losses, grads, _ = train_steps(built, meter, cfg.optim, 2, 0, _chat_batch, loss_fn)
    return losses, grads, built.compiled_blocks


def test_every_policy_stays_bitwise_with_gathered_rows(world_of_one, tmp_path) -> None:
    task = _task("llama", "chunked", "supervised")
    policies = [["checkpointing=none"], ["checkpointing=full"], ["checkpointing=selective"],
                ["checkpointing=budget", "checkpointing.budget=0.45"]]
    results = [_policy_steps(p, task.loss, tmp_path) for p in policies]
    ref_losses, ref_grads, _ = results[0]
    for (losses, grads, _), policy in zip(results[1:], policies[1:]):
        assert torch.equal(losses, ref_losses), policy
        assert all(torch.equal(g, grads[n]) for n, g in ref_grads.items()), policy


def test_compiled_blocks_take_batches_of_any_supervised_count(world_of_one, tmp_path) -> None:
    """The head is outside the compiled blocks: its data-dependent row count (another in each
    step) never reaches a graph, so gathering adds no graph and no recompile, and the compiled
    run's losses equal the compiled whole head's."""
    from checkpointing.compiled import graphs_compiled

    compiled = ["checkpointing=full", "train.compile=true", "model.dropout=0"]
    whole = _policy_steps(compiled, _task("llama", "plain", "all").loss, tmp_path)
    graphs = graphs_compiled()
    gathered = _policy_steps(compiled, _task("llama", "plain", "supervised").loss, tmp_path)
    assert whole[2] == gathered[2] == 4 and graphs_compiled() == graphs > 0
    assert _relative(whole[0][0], gathered[0][0]) <= RELATIVE
    assert _relative(whole[0], gathered[0]) <= 10 * RELATIVE  # after one update of 1e-7 apart


# --- sequence slices (2 ranks) ----------------------------------------------------------------

def _sliced(rank: int, world: int) -> dict:
    from sharding.sequence import sequence_slice

    out = {}
    for arch, head in (("llama", "plain"), ("hf", "chunked")):
        tokens, targets = _batch(0.4, seed=5)
        targets[:, SEQ // 2:] = IGNORE_INDEX  # rank 1's slice: not one supervised row
        whole = _run(arch, _task(arch, head, "all"), tokens, targets, POSITIONS)
        model = _model(arch)
        family_named(arch).sequence_parallel(model, dist.group.WORLD)
        mine = [sequence_slice(t, rank, world) for t in (tokens, targets, POSITIONS)]
        loss = _task(arch, head, "supervised").loss(model, *mine)
        loss.backward()
        summed = loss.detach().clone()
        dist.all_reduce(summed)
        grads = {}
        for name, p in model.named_parameters():
            grad = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(grad)
            grads[name] = _relative(whole[1][name], grad) if whole[1][name].any() else 0.0
        out[arch] = {"loss": _relative(whole[0], summed), "mine": loss.item(),
                     "grads": grads}
    return out


@pytest.fixture(scope="module")
def sliced() -> list[dict]:
    return spawn(_sliced, 2)


@pytest.mark.parametrize("arch", ["llama", "hf"])
def test_sequence_slices_gather_their_own_rows_even_none(sliced, arch) -> None:
    assert sliced[1][arch]["mine"] == 0.0  # the empty slice
    for rank in (0, 1):
        assert sliced[rank][arch]["loss"] <= RELATIVE
        # Attention runs in another order across the all-to-all: tolerance for every weight.
        assert max(sliced[rank][arch]["grads"].values()) <= 1e-5


# --- the report's share: from the prepared cache, else the setting, else every row -------------

def test_the_report_plans_the_head_for_the_prepared_caches_share(tmp_path) -> None:
    import json
    import subprocess
    import sys

    import numpy as np

    from tests.helpers import subprocess_env
    from trainer.cli import check
    from trainer.data.demo import chat_records, make_tokenizer, write_jsonl
    from trainer.data.documents import text_datasets
    from trainer.data.sources import document_settings
    from trainer.task import with_head_share

    make_tokenizer(tmp_path / "tok")
    write_jsonl(tmp_path / "chats.jsonl", chat_records(40))
    overrides = ["data=chat", f"data.path={tmp_path / 'chats.jsonl'}", "data.seq_len=64",
                 f"data.tokenizer={tmp_path / 'tok'}", f"data.cache_dir={tmp_path / 'cache'}",
                 "model.vocab_size=300", "train.micro_batch_size=2"]
    cfg, _ = check(overrides, {"WORLD_SIZE": "1"})
    unprepared, note = with_head_share(cfg)
    assert unprepared.checkpointing.head_supervised_fraction is None and "100%" in note
    d = cfg.data
    text_datasets(d.path, d.val_path, d.tokenizer, document_settings(d), d.cache_dir, 300,
                  preparer=True)
    resolved, note = with_head_share(cfg)
    (folder,) = (tmp_path / "cache").glob("*/train/counts.npy")
    share = resolved.checkpointing.head_supervised_fraction
    assert share == np.load(folder)[:, 0].max() / 64 and 0 < share < 1
    assert str(folder.parent.parent) in note
    given, note = with_head_share(check(overrides + ["checkpointing.head_supervised_fraction=0.3"],
                                        {"WORLD_SIZE": "1"})[0])
    assert given.checkpointing.head_supervised_fraction == 0.3 and "30.0%" in note
    assert with_head_share(check(overrides + ["checkpointing.head_rows=all"],
                                 {"WORLD_SIZE": "1"})[0])[1] is None

    result = subprocess.run([sys.executable, "-m", "trainer.report", *overrides, "--out",
                             str(tmp_path / "report")], env=subprocess_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    line = f"head: plain, rows planned at {share:.1%} supervised (the busiest window"
    assert line in result.stdout
    saved = json.loads((tmp_path / "report" / "memory_plan.json").read_text())
    assert saved["head_rows"].startswith(f"rows planned at {share:.1%}")


def test_auto_times_the_output_layer_on_the_planned_rows_only() -> None:
    """auto's FLOPs outside the blocks (trainer/preflight/auto_plan.py's rest_flops) lose the
    output layer's 6 x vocab x dim per row that is not supervised."""
    from trainer.cli import check
    from trainer.preflight.auto_plan import rest_flops
    from trainer.preflight.scenario import Evaluator

    chat = ["data=chat", "data.path=chats.jsonl", "data.tokenizer=tok", "data.seq_len=64",
            "train.micro_batch_size=2", "model.vocab_size=4096"]
    flops = {}
    for share in ("1.0", "0.4"):
        cfg, _ = check(chat + [f"checkpointing.head_supervised_fraction={share}"],
                       {"WORLD_SIZE": "1"})
        flops[share] = rest_flops(cfg, Evaluator(tflops=400).profile(cfg)[0])
    untied_output = 4096 * 128  # the tiny model's output layer
    assert flops["1.0"] - flops["0.4"] == pytest.approx(6 * untied_output * 64 * 2 * 0.6)


@pytest.mark.parametrize("override, key", [
    ("checkpointing.head_supervised_fraction=1.5", "checkpointing.head_supervised_fraction"),
    ("checkpointing.head_supervised_fraction=0", "checkpointing.head_supervised_fraction"),
    ("checkpointing.head_rows=some", "checkpointing.head_rows")])
def test_bad_head_row_settings_name_their_key(override, key) -> None:
    from trainer.cli import check
    from trainer.config import ConfigError

    with pytest.raises(ConfigError) as raised:
        check([override], {"WORLD_SIZE": "1"})
    assert raised.value.key == key
