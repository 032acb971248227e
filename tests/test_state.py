"""Training-state checkpoints in-process: reshard on load, retention, torn and corrupt folders,
async saves that copy before returning, export."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import zlib

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

from tests.dist import spawn
from trainer.state.checkpoint import COMMIT, Checkpointer, checkpoint_path, list_checkpoints, verify

FULL = StateDictOptions(full_state_dict=True)  # every rank gets the full tensors


def _model_and_optimizer(world_size: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.Linear(16, 4))
    if world_size > 1 or dist.is_initialized():
        mesh = dist.init_device_mesh("cpu", (world_size,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, offset: int = 0) -> None:
    for step in range(offset, offset + steps):
        generator = torch.Generator().manual_seed(step)
        model(torch.randn(8, 16, generator=generator)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _full(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    model_state, optim_state = get_state_dict(model, optimizer, options=FULL)
    return ({k: v.clone() for k, v in model_state.items()},
            {k: {n: (t.clone() if torch.is_tensor(t) else t) for n, t in v.items()}
             for k, v in optim_state["state"].items()})


def _state(step: int) -> dict:
    # A family that exports its tensors as the model names them (the ViT's; the built-in
    # Llama's and Qwen3's export in transformers' names: tests/test_qwen3.py).
    return {"progress": {"step": step}, "config": {"model": {"name": "toy", "arch": "vit"}}}


def _save_after_training(rank: int, world_size: int, root: str) -> tuple[dict, dict]:
    model, optimizer = _model_and_optimizer(world_size)
    _train(model, optimizer, steps=3)
    checkpointer = Checkpointer(root, keep=2, async_save=False, rank=rank,
                                world_size=world_size, device=torch.device("cpu"))
    checkpointer.save(3, model, optimizer, _state(3))
    return _full(model, optimizer)


def _load(rank: int, world_size: int, root: str, saved_by: int) -> tuple[dict, dict]:
    model, optimizer = _model_and_optimizer(world_size)
    _train(model, optimizer, steps=1, offset=100)  # different state, to be overwritten
    checkpointer = Checkpointer(root, keep=2, async_save=False, rank=rank,
                                world_size=world_size, device=torch.device("cpu"))
    loaded = checkpointer.load_latest(model, optimizer)
    assert loaded is not None and loaded.state == _state(3)
    assert loaded.rng_restored == (rank < saved_by)  # a new rank has no saved generator
    return _full(model, optimizer)


def _assert_equal_states(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    (model_a, optim_a), (model_b, optim_b) = a, b
    assert model_a.keys() == model_b.keys() and optim_a.keys() == optim_b.keys()
    for key in model_a:
        assert torch.equal(model_a[key], model_b[key]), key
    for key in optim_a:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(torch.as_tensor(optim_a[key][name]),
                               torch.as_tensor(optim_b[key][name])), (key, name)


@pytest.mark.parametrize("save_world, load_world", [(2, 1), (1, 2)])
def test_reshard_on_load_restores_model_and_optimizer_exactly(tmp_path, save_world,
                                                               load_world) -> None:
    saved = spawn(_save_after_training, save_world, str(tmp_path))[0]
    assert verify(checkpoint_path(str(tmp_path), 3)) is None
    loaded = spawn(_load, load_world, str(tmp_path), save_world)
    for rank_state in loaded:
        _assert_equal_states(saved, rank_state)


def _save_steps(rank: int, world_size: int, root: str, steps: list[int], keep: int,
                async_save: bool) -> list[dict]:
    model, optimizer = _model_and_optimizer(world_size)
    checkpointer = Checkpointer(root, keep=keep, async_save=async_save, rank=rank,
                                world_size=world_size, device=torch.device("cpu"))
    saved = []
    for step in steps:
        _train(model, optimizer, steps=1, offset=step)
        checkpointer.save(step, model, optimizer, _state(step))
        saved.append(_full(model, optimizer)[0])
        # Training goes on while an async save is written: it must have copied the state.
        _train(model, optimizer, steps=1, offset=1000 + step)
    checkpointer.close()
    return saved


def test_keeps_the_newest_committed_and_never_the_torn(tmp_path) -> None:
    root = str(tmp_path)
    spawn(_save_steps, 2, root, [1, 2, 3], 2, False)
    assert [s for s, _ in list_checkpoints(root)] == [3, 2]
    # A save killed half way: shards written, no commit marker. It is never loaded, and the
    # next commit removes it.
    torn = checkpoint_path(root, 4)
    shutil.copytree(checkpoint_path(root, 3), torn)
    os.remove(os.path.join(torn, COMMIT))
    assert verify(torn).startswith("no COMMITTED.json")
    spawn(_save_steps, 2, root, [5], 2, False)
    assert [s for s, _ in list_checkpoints(root)] == [5, 3]


def _rewrite(folder: str, name: str, data: bytes) -> None:
    """Replace a file and its size and checksum in COMMITTED.json: damage the checksums miss."""
    with open(os.path.join(folder, name), "wb") as f:
        f.write(data)
    with open(os.path.join(folder, COMMIT)) as f:
        commit = json.load(f)
    commit["files"][name] = [len(data), zlib.crc32(data)]
    with open(os.path.join(folder, COMMIT), "w") as f:
        json.dump(commit, f)


class _Payload:
    def __reduce__(self):
        return (os.system, ("true",))


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "delete the marker",
                                    "state.json not JSON", "rng file a pickled object"])
def test_damaged_newest_checkpoint_is_skipped_with_its_name(tmp_path, damage, caplog) -> None:
    """Issue 27 item 8 adds the last two: files matching their checksums, yet not what they
    should be, are named and skipped like any other damage."""
    root = str(tmp_path)
    saved = spawn(_save_steps, 2, root, [1, 2], 3, False)[0]
    newest = checkpoint_path(root, 2)
    shard = os.path.join(newest, "__1_0.distcp")
    if damage == "flip a byte":
        with open(shard, "r+b") as f:
            f.seek(os.path.getsize(shard) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
        expected = "__1_0.distcp does not match its checksum"
    elif damage == "truncate":
        os.truncate(shard, os.path.getsize(shard) - 1)
        expected = "__1_0.distcp has"
    elif damage == "delete the marker":
        os.remove(os.path.join(newest, COMMIT))
        expected = "no COMMITTED.json"
    elif damage == "state.json not JSON":
        _rewrite(newest, "state.json", b'{"progress": {step: 2}}')
        expected = "state.json cannot be read as JSON (Expecting property name"
    else:
        _rewrite(newest, "rng/rank0.pt", pickle.dumps(_Payload()))
        expected = "rng/rank0.pt names posix.system, which generator states never hold"
    assert expected in verify(newest)

    model, optimizer = _model_and_optimizer(1)
    checkpointer = Checkpointer(root, keep=3, async_save=False, rank=0, world_size=1,
                                device=torch.device("cpu"))
    with caplog.at_level("WARNING", logger="trainer"):
        loaded = checkpointer.load_latest(model, optimizer)
    assert loaded.path == checkpoint_path(root, 1)
    assert f"checkpoint {newest} skipped: {expected}" in caplog.text
    assert "weights_only" not in caplog.text  # never the advice to turn the safety off
    state = model.state_dict()
    assert all(torch.equal(state[k], saved[0][k]) for k in saved[0])


def test_async_save_commits_what_was_there_when_it_started(tmp_path) -> None:
    root = str(tmp_path)
    saved = spawn(_save_steps, 2, root, [1, 2], 2, True)[0]
    model, optimizer = _model_and_optimizer(1)
    checkpointer = Checkpointer(root, keep=2, async_save=False, rank=0, world_size=1,
                                device=torch.device("cpu"))
    loaded = checkpointer.load_latest(model, optimizer)
    assert loaded.path == checkpoint_path(root, 2)
    state = model.state_dict()
    assert all(torch.equal(state[k], saved[1][k]) for k in saved[1])
    with open(os.path.join(loaded.path, COMMIT)) as f:
        assert json.load(f)["world_size"] == 2


def test_export_writes_the_full_model_as_safetensors(tmp_path) -> None:
    from safetensors.torch import load_file

    from trainer.state.export import main as export_main

    run = tmp_path / "run"
    saved = spawn(_save_steps, 2, str(run / "checkpoints"), [1, 2], 2, False)[0]
    assert export_main([str(run)]) == 0  # a run directory: its newest committed checkpoint
    exported = load_file(run / "export" / "step_00000002" / "model.safetensors")
    assert exported.keys() == saved[1].keys()
    assert all(torch.equal(exported[k], saved[1][k]) for k in exported)
    with open(run / "export" / "step_00000002" / "config.json") as f:
        assert json.load(f)["model"] == {"name": "toy", "arch": "vit"}
    # A checkpoint whose files no longer match their commit marker is refused, naming why.
    with open(run / "checkpoints" / "step_00000001" / "state.json", "a") as f:
        f.write(" ")
    with pytest.raises(SystemExit, match="state.json has"):
        export_main([str(run / "checkpoints" / "step_00000001"), "--out", str(tmp_path / "x")])


def test_a_second_ctrl_c_during_a_save_stops_at_once_and_removes_the_torn_folder(
        tmp_path, monkeypatch) -> None:
    """Issue 27 item 6: DCP wraps the KeyboardInterrupt of a second Ctrl-C in its own
    exception; it is a stop at once (exit 130 at the entry point), not a failed save (74)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    model, optimizer = _model_and_optimizer(1)
    checkpointer = Checkpointer(str(tmp_path), keep=2, async_save=False, rank=0, world_size=1,
                                device=torch.device("cpu"))
    checkpointer.save(1, model, optimizer, _state(1))
    monkeypatch.setattr(FileSystemWriter, "write_data", interrupted)
    with pytest.raises(KeyboardInterrupt):
        checkpointer.save(2, model, optimizer, _state(2))
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [1]  # the torn folder is gone
