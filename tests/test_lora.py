"""LoRA (model.lora, trainer/models/families/lora.py): adapters on a frozen base, sharded with it.

Every checkpointing policy gives the adapters bit-identical gradients (dropout on, 1 and 2
ranks); 2 ranks agree with 1; the loss equals a plain PEFT loop's on the same HF model; a
checkpoint reshards exactly onto another world size."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from checkpointing.meter import SavedBytesMeter
from tests.checkpoint_harness import POLICIES, SMALL, batch
from tests.dist import spawn
from tests.helpers import config, layout_of
from trainer.build import build_model
from trainer.distenv import init_distributed, read_env, shutdown
from trainer.models.llama import lm_loss
from trainer.optim import build_optimizer, build_scheduler, clip_grad_norm

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.dropout=0.1"]
FULL = StateDictOptions(full_state_dict=True)


def _full(tensor):
    tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return tensor.detach().clone()


def _train(overrides: list[str], steps: int, rank: int, make_batch=None):
    """(losses, the last step's gradients by name: None where a parameter has none) of a few
    optimizer steps; the first step moves lora_B off zero, so later steps reach lora_A too."""
    cfg = config(*SMALL, *overrides)
    torch.manual_seed(7 + rank)  # dropout masks: the same sequence for every policy
    built = build_model(cfg, read_env("cpu"), layout=layout_of(cfg), meter=SavedBytesMeter())
    model, optimizer = built.model, build_optimizer(built.model, cfg.optim)
    losses, grads = [], {}
    for step in range(steps):
        tokens = make_batch(step, rank) if make_batch else batch(step, rank)
        loss = lm_loss(model, tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        grads = {n: None if p.grad is None else _full(p.grad) for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
    return torch.stack(losses), grads, [p.recompute for p in built.plan]


HF_DROPOUT = ["model=hf", "model.dropout=0",
              "model.hf_config={model_type: llama, vocab_size: 256, hidden_size: 64, "
              "intermediate_size: 128, num_hidden_layers: 4, num_attention_heads: 4, "
              "num_key_value_heads: 2, max_position_embeddings: 128, attention_dropout: 0.1}"]
MODELS = {"llama": ["model=tiny"], "hf": HF_DROPOUT}


def _policies(rank: int, world_size: int, model: str = "llama"):
    return [_train([*MODELS[model], *LORA, *policy], 3, rank) for policy in POLICIES]


def _assert_adapters_only_and_bitwise(results) -> None:
    ref_losses, ref_grads, _ = results[0]
    adapters = {n for n, g in ref_grads.items() if g is not None}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    assert len(adapters) < len(ref_grads)  # the base has no gradients
    assert all(ref_grads[n].abs().sum() > 0 for n in adapters)  # lora_A's too, after step 1
    for (losses, grads, plan), policy in zip(results[1:], POLICIES[1:]):
        assert any(r != "none" for r in plan), policy
        assert torch.equal(losses, ref_losses), policy
        assert {n for n, g in grads.items() if g is not None} == adapters, policy
        for name in adapters:
            assert torch.equal(grads[name], ref_grads[name]), (policy, name)


def _one_rank(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(key, raising=False)
    init_distributed(read_env("cpu"), timeout_s=60)  # a world of one, as `python -m trainer`


@pytest.mark.parametrize("model", ["llama", "hf"])
def test_every_policy_gives_bitwise_identical_adapter_gradients_one_rank(monkeypatch,
                                                                          model) -> None:
    _one_rank(monkeypatch)
    try:
        results = _policies(0, 1, model)
    finally:
        shutdown()
    _assert_adapters_only_and_bitwise(results)


@pytest.mark.slow
def test_every_policy_gives_bitwise_identical_adapter_gradients_two_ranks() -> None:
    for results in spawn(_policies, 2):
        _assert_adapters_only_and_bitwise(results)


NO_DROPOUT = ["model=tiny", "model.dropout=0", "model.lora.rank=4", "model.lora.alpha=8"]


def _both_halves(step: int, rank: int) -> torch.Tensor:
    return torch.cat([batch(step, 0), batch(step, 1)])


def _sharded(rank: int, world_size: int):
    losses, grads, _ = _train(NO_DROPOUT, 3, rank)
    dist.all_reduce(losses)  # the mean over ranks: the loss of the whole global batch
    return losses / world_size, grads


def test_two_ranks_agree_with_one(monkeypatch) -> None:
    two = spawn(_sharded, 2)[0]
    _one_rank(monkeypatch)
    try:
        one = _train([*NO_DROPOUT, "train.micro_batch_size=8"], 3, 0, make_batch=_both_halves)
    finally:
        shutdown()
    torch.testing.assert_close(two[0], one[0], rtol=0, atol=1e-6)
    for name, grad in one[1].items():
        if grad is None:
            assert two[1][name] is None, name
        else:
            torch.testing.assert_close(two[1][name], grad, rtol=0, atol=1e-6, msg=name)


HF = ("model.hf_config={model_type: llama, vocab_size: 256, hidden_size: 64, "
      "intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, "
      "num_key_value_heads: 2, max_position_embeddings: 128}")
# A constant learning rate and clipping on: what the plain loop below does too.
PEFT_RUN = ["model=hf", HF, "model.dropout=0", "model.lora.rank=8", "model.lora.alpha=16",
            "model.lora.targets=[*q_proj,*v_proj,*down_proj]", "optim.lr=1e-2",
            "optim.warmup_steps=0", "optim.min_lr_ratio=1.0", "optim.grad_clip=1.0"]


def _plain_peft_loop(state: dict, targets: list[str], cfg, steps: int) -> list[float]:
    """What a PEFT user writes: AutoModelForCausalLM, get_peft_model, AdamW, labels=."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.models.hf import _hf_config

    hf_config = _hf_config(cfg.model.hf_config, None)
    hf_config._attn_implementation = "sdpa"
    lora = cfg.model.lora
    model = get_peft_model(AutoModelForCausalLM.from_config(hf_config), LoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
        target_modules=[t.removeprefix("hf.") for t in targets]))
    # The same starting values: the base weights and adapters our run drew.
    model.base_model.model.load_state_dict({k.removeprefix("hf."): v for k, v in state.items()})
    trained = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optim
    optimizer = torch.optim.AdamW(trained, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                  weight_decay=o.weight_decay)
    model.train()
    losses = []
    for step in range(steps):
        loss = model(input_ids=batch(step), labels=batch(step)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, o.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_our_lora_loss_equals_a_plain_peft_loop(monkeypatch) -> None:
    _one_rank(monkeypatch)
    try:
        cfg = config(*SMALL, *PEFT_RUN)
        built = build_model(cfg, read_env("cpu"), layout=layout_of(cfg), meter=SavedBytesMeter())
        model = built.model
        state = {k: _full(v) for k, v in model.state_dict().items()}
        optimizer = build_optimizer(model, cfg.optim)
        scheduler = build_scheduler(optimizer, cfg.optim, total_steps=5)
        ours = []
        for step in range(5):
            tokens = batch(step)
            loss = lm_loss(model, tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            clip_grad_norm(model.parameters(), cfg.optim.grad_clip)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            ours.append(loss.item())
        targets = model.lora_targets
    finally:
        shutdown()
    assert len(targets) == 6  # 3 patterns x 2 layers
    plain = _plain_peft_loop(state, targets, cfg, 5)
    assert ours[-1] < ours[0]  # it learns (the loop is not a copy of one step)
    for step, (a, b) in enumerate(zip(ours, plain)):
        assert abs(a - b) <= 1e-6, (step, ours, plain)


def _save(rank: int, world_size: int, root: str):
    from trainer.state.checkpoint import Checkpointer

    cfg = config(*SMALL, *NO_DROPOUT)
    built = build_model(cfg, read_env("cpu"), layout=layout_of(cfg), meter=SavedBytesMeter())
    optimizer = build_optimizer(built.model, cfg.optim)
    for step in range(2):
        tokens = batch(step, rank)
        lm_loss(built.model, tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
    import dataclasses

    Checkpointer(root, 2, False, rank, world_size, torch.device("cpu"),
                 dataclasses.asdict(cfg.model)).save(
        2, built.model, optimizer, {"progress": {"step": 2},
                                    "config": {"model": dataclasses.asdict(cfg.model)}})
    return _states(built.model, optimizer)


def _states(model, optimizer):
    model_state, optim_state = get_state_dict(model, optimizer, options=FULL)
    return ({k: v.clone() for k, v in model_state.items()},
            {k: {n: torch.as_tensor(t).clone() for n, t in v.items()}
             for k, v in optim_state["state"].items()})


def _load(rank: int, world_size: int, root: str, overrides: list[str]):
    import dataclasses

    from trainer.state.checkpoint import Checkpointer

    cfg = config(*SMALL, *NO_DROPOUT, *overrides)
    built = build_model(cfg, read_env("cpu"), layout=layout_of(cfg), meter=SavedBytesMeter())
    optimizer = build_optimizer(built.model, cfg.optim)
    Checkpointer(root, 2, False, rank, world_size, torch.device("cpu"),
                 dataclasses.asdict(cfg.model)).load_latest(built.model, optimizer)
    return _states(built.model, optimizer)


def test_resume_on_another_world_size_is_bitwise_and_other_lora_settings_are_refused(
        tmp_path) -> None:
    saved = spawn(_save, 2, str(tmp_path))[0]
    loaded = spawn(_load, 1, str(tmp_path), [])[0]
    assert saved[0].keys() == loaded[0].keys() and saved[1].keys() == loaded[1].keys()
    assert len(saved[1]) == 4 * 7 * 2  # optimizer state for the adapters alone (A, B x 28)
    for key in saved[0]:
        assert torch.equal(saved[0][key], loaded[0][key]), key
    for key in saved[1]:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(saved[1][key][name], loaded[1][key][name]), (key, name)
    # Shapes fit, the adapters differ: a ConfigError naming the setting (the one line).
    with pytest.raises(AssertionError, match=r"ConfigError: model\.lora\.alpha: 8\.0 -> 4\.0 "):
        spawn(_load, 1, str(tmp_path), ["model.lora.alpha=4"])


@pytest.mark.parametrize("argv, line", [
    (["model.lora.rank=0"], "error: model.lora.rank: must be a positive integer"),
    (["model.lora.rank=4", "model.lora.targets=[nope*]"],
     "error: model.lora.targets: 'nope*' matches no linear layer"),
    (["model.lora.quantize=nf4"], "error: model.lora.quantize: nf4 quantizes the frozen base"),
    (["model.lora.targets=[*wq]"], "error: model.lora.targets: adapters are on with"),
    (["model.lora.rank=4", "model.lora.quantize=nf4", "model.dim=40", "model.n_heads=4",
      "model.n_kv_heads=2"], "error: model.lora.quantize: nf4 quantizes in blocks of 64"),
    (["model=vit_tiny", "data=synthetic_images", "model.lora.rank=4"],
     "error: model.lora.rank: LoRA adapts language models"),
    (["model.lora.rank=4", "model.lora.alpha=0"], "error: model.lora.alpha: must be > 0"),
    (["model.lora.rank=4", "model.freeze=[tok_embeddings.*]"], "error: model.freeze: with LoRA"),
])
def test_bad_lora_settings_are_one_line_before_anything_starts(capsys, argv, line) -> None:
    from trainer.cli import check_command

    status = check_command(["train.device=cpu", "data=synthetic", *argv], {})
    err = capsys.readouterr().err.strip()
    assert status == 2 and err.startswith(line) and "\n" not in err, err
