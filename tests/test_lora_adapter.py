"""model.lora.adapter: a run's adapters start from a PEFT adapter folder (as `trainer.export
--adapter` writes), the built-in Llama's rotary rows put back as the export reordered them; a
folder that is missing, not an adapter, for another base or of another rank is refused in one
line naming the key, before anything starts."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from tests.helpers import REPO, check_ok, config, losses, run_trainer
from trainer.build import build_on_meta, materialize

TINY = ["model=tiny", "model.dim=64", "model.n_layers=2", "model.ffn_hidden=128",
        "model.lora.rank=4", "model.lora.alpha=8"]


def _adapted(*overrides: str) -> torch.nn.Module:
    cfg = config(*TINY, *overrides)
    model = build_on_meta(cfg.model)
    materialize(model, torch.device("cpu"), seed=0)
    return model


def _adapters(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> tuple[str, dict]:
    """An adapter folder of the built-in Llama with random lora_A and lora_B (lora_B is zero
    as drawn: a load that did nothing would still match it), and those values."""
    from trainer.state.export_lora import export_adapter

    model = _adapted()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
    out = str(tmp_path_factory.mktemp("adapter"))
    export_adapter(model.state_dict(), dataclasses.asdict(config(*TINY).model), out)
    return out, _adapters(model)


def test_the_adapter_folder_starts_the_adapters_bitwise(adapter) -> None:
    folder, values = adapter
    started = _adapters(_adapted(f"model.lora.adapter={folder}"))
    assert started.keys() == values.keys()
    assert all(torch.equal(started[name], values[name]) for name in values)
    fresh = _adapters(_adapted())  # without the folder the adapters are drawn (lora_B zero)
    assert not any(torch.equal(fresh[name], values[name]) for name in values)


def _write(folder, **changes) -> str:
    """A copy of the adapter folder with adapter_config.json's keys changed."""
    source, out = changes.pop("source"), changes.pop("out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(source, "adapter_config.json")) as f:
        saved = json.load(f)
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump({**saved, **changes}, f)
    os.symlink(os.path.join(source, "adapter_model.safetensors"),
               os.path.join(out, "adapter_model.safetensors"))
    return out


@pytest.mark.parametrize("case, extra, line", [
    ("missing", [], "error: model.lora.adapter: {tmp}/nope: no such folder"),
    ("empty", [], "error: model.lora.adapter: {tmp}/empty is not a PEFT adapter folder"),
    ("shapes", ["model.dim=32", "model.ffn_hidden=64"],
     "error: model.lora.adapter: {folder} adapts another base: "),
    ("path", [], "error: model.lora.adapter: {tmp}/path adapts another base (/elsewhere)"),
    ("rank", ["model.lora.rank=8"], "error: model.lora.rank: 8, but the adapter at {folder} "
     "has r=4"),
    ("targets", ["model.lora.targets=[*.wq]"], "error: model.lora.targets: the adapter at "
     "{folder} also holds"),
    ("off", ["model.lora.rank=null"], "error: model.lora.adapter: starts LoRA's adapters"),
])
def test_a_folder_that_cannot_start_the_adapters_is_one_line(capsys, tmp_path, adapter, case,
                                                             extra, line) -> None:
    from trainer.cli import check_command

    folder = adapter[0]
    paths = {"missing": str(tmp_path / "nope"), "empty": str(tmp_path / "empty"),
             "path": str(tmp_path / "path")}
    os.makedirs(paths["empty"])
    if case == "path":
        _write(folder, source=folder, out=paths["path"], base_model_name_or_path="/elsewhere")
    status = check_command(["train.device=cpu", "data=synthetic", *TINY, *extra,
                            f"model.lora.adapter={paths.get(case, folder)}"], {})
    err = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in err and "Traceback" not in err, err
    assert err.startswith(line.format(tmp=tmp_path, folder=folder)), err


HF = ["model=hf", "model.dropout=0", "model.lora.rank=4", "model.lora.alpha=8",
      "optim.lr=1e-2", "optim.warmup_steps=0", "data=synthetic", "data.seq_len=32",
      "train.micro_batch_size=2", "train.device=cpu", "logging.every=1", "logging.wandb=false",
      "logging.progress=false"]


def _run(tmp_path, name: str, *overrides: str) -> list[float]:
    run_dir = tmp_path / name
    check_ok(run_trainer([*HF, *overrides, f"hydra.run.dir={run_dir}"], REPO,
                         timeout=600))
    return losses(run_dir)


def test_a_new_run_from_an_exported_adapter_starts_at_its_loss(tmp_path) -> None:
    """Train, export the adapter and the merged model; a run of the base with the adapter has
    the merged model's first loss (the same batch: same data and seed), and not the base's."""
    from tests.test_lora_export import _base_folder
    from trainer.state.export import main as export_main

    base = _base_folder(str(tmp_path / "base"))
    trained = _run(tmp_path, "first", f"model.path={base}", "train.steps=3")
    assert export_main([str(tmp_path / "first"), "--adapter", "--out",
                        str(tmp_path / "adapter")]) == 0
    assert export_main([str(tmp_path / "first"), "--out", str(tmp_path / "merged")]) == 0
    started = _run(tmp_path, "second", f"model.path={base}", "train.steps=1",
                   f"model.lora.adapter={tmp_path / 'adapter'}")[0]
    merged = _run(tmp_path, "merged_run", f"model.path={tmp_path / 'merged'}",
                  "train.steps=1")[0]
    assert abs(started - trained[0]) > 1e-3  # the base's first loss: the adapters count
    assert abs(started - merged) <= 1e-6, (started, merged)
