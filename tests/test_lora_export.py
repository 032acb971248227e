"""A LoRA run's exports (trainer/state/export_lora.py): the adapter alone loads with
PeftModel.from_pretrained on the base folder, the merged model with AutoModelForCausalLM, and
both give the trained model's logits within 1e-5."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from checkpointing.meter import SavedBytesMeter
from tests.checkpoint_harness import batch
from tests.dist import spawn
from tests.helpers import config, layout_of
from trainer.build import build_model
from trainer.distenv import read_env
from trainer.models.llama import lm_loss
from trainer.optim import build_optimizer

RUN = ["data.seq_len=32", "train.micro_batch_size=2", "model.lora.rank=4",
       "model.lora.alpha=8", "optim.lr=1e-2"]


def _base_folder(path: str) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config_ = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=128)
    AutoModelForCausalLM.from_config(config_).save_pretrained(path)
    return path


def _train_and_save(rank: int, world_size: int, overrides: list[str], root: str):
    """Three steps (lora_B away from zero), a checkpoint, and the model's logits on a batch."""
    from trainer.state.checkpoint import Checkpointer

    cfg = config(*RUN, *overrides)
    built = build_model(cfg, read_env("cpu"), layout=layout_of(cfg), meter=SavedBytesMeter())
    optimizer = build_optimizer(built.model, cfg.optim)
    for step in range(3):
        tokens = batch(step, rank, size=2, seq=32)
        lm_loss(built.model, tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
    model_cfg = dataclasses.asdict(cfg.model)
    Checkpointer(root, 2, False, rank, world_size, torch.device("cpu"), model_cfg).save(
        3, built.model, optimizer, {"progress": {"step": 3}, "config": {"model": model_cfg}})
    built.model.eval()
    with torch.no_grad():
        return built.model(batch(9, size=2, seq=32)).detach().clone()


def _export_both(tmp_path, overrides):
    from trainer.state.checkpoint import list_checkpoints
    from trainer.state.export import export

    ours = spawn(_train_and_save, 2, overrides, str(tmp_path / "ckpt"))[0]
    folder = list_checkpoints(str(tmp_path / "ckpt"))[0][1]
    adapter = export(folder, str(tmp_path / "adapter"), adapter=True)
    merged = export(folder, str(tmp_path / "merged"))
    return ours, folder, adapter, merged


def _logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=batch(9, size=2, seq=32)).logits


def test_hf_adapter_and_merged_exports_load_and_give_our_logits(tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = _base_folder(str(tmp_path / "base"))
    ours, _, adapter, merged = _export_both(tmp_path, ["model=hf", f"model.path={base}",
                                                       "model.dropout=0"])
    assert sorted(os.listdir(adapter)) == ["adapter_config.json", "adapter_model.safetensors"]
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        saved = json.load(f)
    assert (saved["r"], saved["lora_alpha"], saved["base_model_name_or_path"]) == (4, 8, base)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    plain = AutoModelForCausalLM.from_pretrained(base)
    # The adapters changed the model (so matching logits say they were loaded).
    assert (_logits(plain) - ours).abs().max() > 1e-3
    torch.testing.assert_close(_logits(peft), ours, rtol=0, atol=1e-5)
    torch.testing.assert_close(_logits(AutoModelForCausalLM.from_pretrained(merged)), ours,
                               rtol=0, atol=1e-5)


def test_builtin_llama_adapter_loads_on_its_base_export(tmp_path) -> None:
    """The built-in Llama's adapters under transformers' names (rotary rows of wq/wk's lora_B
    reordered as the export reorders the weights), on its base exported the same way."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from trainer.models.families.llama import FAMILY
    from trainer.models.families.lora import base_name, is_adapter
    from trainer.state.export import load_model_state

    tiny = ["model=tiny", "model.dim=64", "model.n_layers=2", "model.ffn_hidden=128"]
    ours, folder, adapter, merged = _export_both(tmp_path, tiny)
    with open(os.path.join(folder, "state.json")) as f:
        model_cfg = json.load(f)["config"]["model"]
    base_state = {base_name(k): v for k, v in load_model_state(folder).items()
                  if not is_adapter(k)}
    base = FAMILY.export(base_state, {**model_cfg, "lora": None}, str(tmp_path / "base"), 3,
                         folder)
    assert "lm_head.weight" in load_file(os.path.join(base, "model.safetensors"))
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    torch.testing.assert_close(_logits(peft), ours, rtol=0, atol=1e-5)
    torch.testing.assert_close(_logits(AutoModelForCausalLM.from_pretrained(merged)), ours,
                               rtol=0, atol=1e-5)


def test_adapter_export_of_a_run_without_lora_is_refused(tmp_path) -> None:
    from trainer.state.export_lora import export_adapter

    with pytest.raises(SystemExit, match="--adapter: this checkpoint trained no adapters"):
        export_adapter({}, {"arch": "llama", "lora": {"rank": None}}, str(tmp_path))
