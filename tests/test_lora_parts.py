"""LoRA with the rest of the plan (issue 46): offload of saved activations, sequence tiles, the
chunked head and `sharding.sequence`, through the Trainer as a run builds it, on 2 gloo ranks
(one spawn for every case) and against one rank on the same samples; an adapter folder loaded
onto 2 FSDP ranks as onto one; and on one rank (build_model, dropout on) the chunked head
alone, and adapter dropout inside tiles.

Only the adapters have gradients; every case compares them (and the loss, the validation loss)
with a reference run. Bitwise where the sums are the same (a checkpointing policy with offload
to disk or host); within tests/test_sequence_runs.py's relative 1e-6 where the chunked head
rounds otherwise, and for adapter gradients within ADAPTER_TILES where tiles or the sequence
split cut their sums over the tokens. Adapter dropout (`model.lora.dropout`) stays on at one
degree without tiles; across degrees it is 0, as attention dropout is there: a rank holding half
the tokens cannot draw the masks one rank draws for all of them; nor does a tile draw the whole
sequence's (in tiles it is checked against tiles alone)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist import spawn
from tests.test_sequence_runs import HF_LLAMA, TOLERANCE, _worst, chat
from tests.test_sequence_runs import work  # noqa: F401 (a fixture)

LORA = ["model.lora.rank=4", "model.lora.alpha=8"]
N1 = ["train.micro_batch_size=2", "train.eval_batches=1"]
N2 = ["train.micro_batch_size=1", "sharding.sequence=2", "train.eval_batches=4"]
CHUNKED = ["checkpointing.head=chunked", "checkpointing.head_chunk_tokens=16"]
DISK = ["offload=disk", "offload.min_bytes=0", "offload.keep_last=0"]
HF = [*LORA, "model=hf", HF_LLAMA]
ONE = ["train.micro_batch_size=4", "train.eval_batches=1"]  # N1's samples on one rank


def _trainer(overrides: list[str], run_dir: str):
    from trainer.distenv import read_env
    from trainer.loop import Trainer
    from trainer.validate import validate
    from tests.helpers import config

    cfg = config(*overrides, f"train.out_dir={run_dir}")
    layout = validate(cfg, world_size=dist.get_world_size())
    denv = read_env("cpu")
    os.makedirs(run_dir, exist_ok=True)
    torch.manual_seed(cfg.train.seed + denv.rank)  # as trainer.loop.train seeds dropout
    return Trainer(cfg, layout, run_dir, denv), denv


def _one_step(overrides: list[str], run_dir: str) -> dict:
    """The first step's loss, the full gradients of what has one (the optimizer held still),
    and the validation loss."""
    from checkpointing.blocks import canonical_name
    from trainer.loop import _to, train_step
    from trainer.observe.evaluate import evaluate

    trainer, denv = _trainer(overrides, run_dir)
    try:
        optimizer = trainer.model_state.optimizer
        optimizer.step = lambda *args, **kwargs: None
        optimizer.zero_grad = lambda *args, **kwargs: None
        batch, counts = trainer.data.batch(0)
        loss, _, _, _ = train_step(trainer.step_parts, _to(batch, denv.device),
                                   trainer.task.loss, counts and counts[0])
        model = trainer.model_state.model
        grads = {canonical_name(n): p.grad.full_tensor() for n, p in model.named_parameters()
                 if p.grad is not None}
        val = evaluate(model, trainer.data.val, trainer.task, denv.device)["val_loss"]
        frozen = sum(not p.requires_grad for p in model.parameters())
        adapters = {canonical_name(n): p.full_tensor().detach().clone()
                    for n, p in model.named_parameters() if p.requires_grad}  # held still
        return {"loss": float(loss), "val": val, "grads": grads, "frozen": frozen,
                "offloaded": trainer.built.plan[0].offload, "adapters": adapters}
    finally:
        trainer.closing.close()


def _cases(work: Path, adapters: dict) -> dict:
    # Adapters from a folder of random values: lora_B drawn as zero would leave lora_A without
    # gradients and the adapters out of the forward.
    base = [*chat(work), *LORA, f"model.lora.adapter={adapters['llama']}"]
    still, dropping = [*base, "model.dropout=0.0"], [*base, "model.dropout=0.1",
                                                     "model.lora.dropout=0.1"]
    hf = [*chat(work), *HF, f"model.lora.adapter={adapters['hf']}"]
    return {
        # bitwise: a policy that saves to disk / the host against none, dropout on everywhere
        "selective-disk": ([*dropping, *N1, "checkpointing=selective", *DISK], [*dropping, *N1]),
        "full-cpu": ([*dropping, *N1, "checkpointing=full", "offload=cpu",
                      "offload.min_bytes=0", "offload.keep_last=0"], [*dropping, *N1]),
        # the order of sums changes: tiles, the chunked head, the sequence split
        "tiles-chunked": ([*still, *N1, "checkpointing=full", "checkpointing.tiles=2",
                           *CHUNKED], [*still, *N1]),
        "sequence": ([*still, *N2, *CHUNKED], [*still, *N1, *CHUNKED]),
        "hf-sequence-tiles": ([*hf, *N2, "checkpointing=full", "checkpointing.tiles=2"],
                              [*hf, *N1]),
    }


def _two_ranks(rank: int, world: int, work: str, adapters: dict) -> dict:
    out = {}
    for name, (run, reference) in _cases(Path(work), adapters).items():
        out[name] = (_one_step(run, os.path.join(work, name, "run")),
                     _one_step(reference, os.path.join(work, name, "reference")))
    out["adapter"] = _one_step([*_loaded(Path(work), adapters), *N1],
                               os.path.join(work, "adapter-run"))
    return out


def _loaded(work: Path, adapters: dict) -> list[str]:
    return [*chat(work), *LORA, "model.dropout=0.0", f"model.lora.adapter={adapters['llama']}"]


def _one_rank(rank: int, world: int, work: str, adapters: dict) -> dict:
    """One rank on the same 4 samples (and 4 validation samples), the plain head."""
    return _one_step([*_loaded(Path(work), adapters), *ONE], os.path.join(work, "one-rank"))


def _adapter_folder(work: Path, name: str, overrides: list[str],
                    scale: float = 0.05) -> tuple[str, dict]:
    """A PEFT adapter folder for a chat run's model, random lora_A and lora_B."""
    from tests.helpers import config
    from trainer.build import build_on_meta, materialize
    from trainer.state.export_lora import export_adapter

    cfg = config(*chat(work), *overrides)
    model = build_on_meta(cfg.model)
    materialize(model, torch.device("cpu"), seed=0)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                # 0.05: the size trained adapters have; unit-sized ones saturate the softmax,
                # where fp32's last bits decide the gradients (exact in float64 either way)
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    out = str(work / f"adapter-{name}")
    export_adapter(model.state_dict(), dataclasses.asdict(cfg.model), out)
    return out, {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}


@pytest.fixture(scope="module")
def ranks(work) -> tuple[list[dict], dict, dict]:
    """Each rank's results on 2 ranks, the llama folder's values, one rank's run."""
    llama, values = _adapter_folder(work, "llama", LORA)
    hf, _ = _adapter_folder(work, "hf", HF)
    folders = {"llama": llama, "hf": hf}
    return (spawn(_two_ranks, 2, str(work), folders), values,
            spawn(_one_rank, 1, str(work), folders)[0])


def _adapters_only(result: dict) -> None:
    assert result["grads"] and all(".lora_A." in n or ".lora_B." in n for n in result["grads"])
    assert all(grad.abs().sum() > 0 for grad in result["grads"].values())
    assert result["frozen"] > 0  # the base is there, without gradients


@pytest.mark.parametrize("name", ["selective-disk", "full-cpu"])
def test_offload_with_a_policy_gives_bitwise_adapter_gradients(ranks, name) -> None:
    for rank in ranks[0]:
        got, want = rank[name]
        _adapters_only(want)
        assert got["offloaded"] != "none", name
        assert got["loss"] == want["loss"] and got["val"] == want["val"], name
        assert got["grads"].keys() == want["grads"].keys()
        for key, grad in want["grads"].items():
            assert torch.equal(got["grads"][key], grad), (name, key)


def _print_worst(name, got, want) -> float:
    worst = _worst(got["grads"], want["grads"])
    print(f"{name}: loss {got['loss']!r} vs {want['loss']!r}, worst gradient {worst:.2e}")
    return worst


# An adapter's gradient is one sum over every token of a product of two rank-4 factors: split
# into tiles, or across a sequence pair against one rank, fp32's reordering of it reaches 1.5e-6
# of the largest element (2026-12-05); in float64 the tiles' split is exact to 1e-12 (below).
ADAPTER_TILES = 5e-6


@pytest.mark.parametrize("name, tolerance", [("tiles-chunked", ADAPTER_TILES),
                                             ("sequence", TOLERANCE),
                                             ("hf-sequence-tiles", ADAPTER_TILES)])
def test_tiles_chunked_head_and_sequence_follow_the_plain_run(ranks, name, tolerance) -> None:
    for rank in ranks[0]:
        got, want = rank[name]
        _adapters_only(got)
        assert got["loss"] == pytest.approx(want["loss"], rel=TOLERANCE, abs=0), name
        assert got["val"] == pytest.approx(want["val"], rel=TOLERANCE, abs=0), name
        assert _print_worst(name, got, want) < tolerance, name


def _float64_grads(folder: str, tiles: int) -> dict:
    from tests.helpers import config
    from trainer.build import build_on_meta, materialize
    from trainer.models.llama import lm_loss

    cfg = config("model=tiny", "model.dropout=0", *LORA, f"model.lora.adapter={folder}")
    model = build_on_meta(cfg.model)
    materialize(model, torch.device("cpu"), seed=0)
    model = model.double()
    for block in model.layers if tiles > 1 else ():
        block.tile(tiles)
    tokens = torch.randint(0, 256, (2, 65), generator=torch.Generator().manual_seed(1))
    lm_loss(model, tokens[:, :-1], tokens[:, 1:]).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_adapter_gradients_in_tiles_are_exact_in_float64(tmp_path) -> None:
    """What is left of the tiles' difference once fp32's rounding is out: nothing (unit-sized
    adapters, where fp32 differs most: 1e-3)."""
    folder, _ = _adapter_folder(tmp_path, "unit", LORA, scale=1.0)
    whole, tiled = _float64_grads(folder, 1), _float64_grads(folder, 3)
    assert len(whole) == 4 * 7 * 2  # 7 adapted linears a block, lora_A and lora_B
    assert _worst(tiled, whole) < 1e-11


def test_an_adapter_folder_starts_both_ranks_bitwise_as_one_rank(ranks) -> None:
    """The folder's values bit for bit (full tensors) on 2 FSDP ranks and on one, and the
    first loss of 2 ranks within 1e-6 of one rank's (test_lora.py's 2-ranks-vs-1 bound)."""
    results, values, one = ranks
    assert sorted(one["adapters"]) == sorted(results[0]["adapter"]["adapters"])
    for rank in [*results, {"adapter": one}]:
        loaded = rank["adapter"]["adapters"]
        assert len(loaded) == len(values) > 0
        for (name, got), want in zip(sorted(loaded.items()), _in_order(values, loaded)):
            assert torch.equal(got, want), name
    for rank in results:
        got = rank["adapter"]
        print(f"adapter on 2 ranks: first loss {got['loss']!r}, one rank {one['loss']!r}")
        assert abs(got["loss"] - one["loss"]) <= 1e-6
        assert got["val"] == pytest.approx(one["val"], rel=TOLERANCE, abs=0)
        assert _worst(got["grads"], one["grads"]) < TOLERANCE


def test_sequence_2_on_two_ranks_follows_one_rank(ranks) -> None:
    """The sequence pair (chunked head) against one rank on the same samples (plain head):
    the adapters' token sums split across the pair, hence ADAPTER_TILES."""
    results, _, one = ranks
    for rank in results:
        got = rank["sequence"][0]
        _adapters_only(got)
        assert got["loss"] == pytest.approx(one["loss"], rel=TOLERANCE, abs=0)
        assert got["val"] == pytest.approx(one["val"], rel=TOLERANCE, abs=0)
        assert _print_worst("sequence vs one rank", got, one) < ADAPTER_TILES


def _in_order(values: dict, loaded: dict) -> list[torch.Tensor]:
    """The folder's values in the loaded names' sorted order (names canonical on both)."""
    from checkpointing.blocks import canonical_name

    by_name = {canonical_name(n): v for n, v in values.items()}
    return [by_name[name] for name in sorted(loaded)]


# --- one rank, build_model as tests/test_lora.py: 3 optimizer steps, dropout on --------------

def _steps(run_dir: str, *overrides: str, steps: int = 3) -> tuple:
    """(losses, the last step's adapter gradients, the plan as (recompute, offload target,
    tiles), the chunk_tokens each forward got) of a few steps of a tiny Llama with the run's own
    loss (trainer/task.py); from fresh adapters, step 1 moves lora_B off zero."""
    from checkpointing.meter import SavedBytesMeter
    from tests.checkpoint_harness import SMALL, train_steps
    from tests.helpers import config, layout_of
    from trainer.build import build_model
    from trainer.distenv import read_env
    from trainer.task import task_for

    cfg = config(*SMALL, "model=tiny", *LORA, "model.lora.dropout=0.1", *overrides)
    torch.manual_seed(7)  # the dropout masks: the same sequence for every run
    built = build_model(cfg, read_env("cpu"), layout=layout_of(cfg), meter=SavedBytesMeter(),
                        run_dir=run_dir)
    chunks = []
    built.model.register_forward_pre_hook(
        lambda module, args, kwargs: chunks.append(kwargs.get("chunk_tokens")), with_kwargs=True)
    losses, grads, _ = train_steps(built, SavedBytesMeter(), cfg.optim, steps, 0, loss_fn=task_for(
        cfg.model, cfg.data, cfg.checkpointing).loss)
    plan = [(p.recompute, p.offload != "none" and p.target, p.tiles) for p in built.plan]
    assert grads and all(".lora_A." in n or ".lora_B." in n for n in grads)
    assert all(grad.abs().sum() > 0 for grad in grads.values())  # lora_A's too
    return losses, grads, plan, chunks


def _bitwise(got: tuple, want: tuple) -> None:
    assert torch.equal(got[0], want[0])
    assert got[1].keys() == want[1].keys()
    assert all(torch.equal(got[1][n], want[1][n]) for n in want[1])


def test_the_chunked_head_follows_the_plain_head(world_of_one, tmp_path) -> None:
    """One step from adapters of random values (so lora_A has gradients), dropout on: the
    chunked head (16 tokens a chunk) rounds each token's hidden gradient otherwise, within
    TOLERANCE. Compared after more steps, Adam's first update (about lr * sign(g)) would turn a
    last-bit difference in a near-zero gradient into a whole step."""
    folder, _ = _adapter_folder(tmp_path, "one", LORA)
    start = ["checkpointing=none", f"model.lora.adapter={folder}"]
    plain = _steps(str(tmp_path), *start, steps=1)
    chunked = _steps(str(tmp_path), *start, *CHUNKED, steps=1)
    assert plain[3] == [None] and chunked[3] == [16]
    worst = _worst(chunked[1], plain[1])
    print(f"chunked: loss {chunked[0].item()!r} vs {plain[0].item()!r}, worst adapter "
          f"gradient {worst:.2e}")
    torch.testing.assert_close(chunked[0], plain[0], rtol=TOLERANCE, atol=0)
    assert worst < TOLERANCE


def test_tiles_replay_adapter_dropout_under_recompute_and_offload(world_of_one,
                                                                 tmp_path) -> None:
    """In tiles PEFT's dropout draws each tile's masks (not the whole sequence's: the cases
    above keep it 0), the same ones again in every recompute: full recompute with disk offload
    in tiles gives tiles alone bit for bit over 3 steps, adapter and model dropout on."""
    tiles = ["checkpointing.tiles=2"]
    alone = _steps(str(tmp_path), *tiles, "checkpointing=none")
    got = _steps(str(tmp_path), *tiles, "checkpointing=full", *DISK)
    assert all(plan == ("full", "disk", 2) for plan in got[2])
    _bitwise(got, alone)
    untiled = _steps(str(tmp_path), "checkpointing=none")  # the whole sequence's masks
    assert _worst(untiled[1], alone[1]) > 1e-3
