"""The trainer's side of `auto` (trainer/preflight/auto_plan.py): device timing, one decision for
all ranks, and the same decision again when the run is started again.

Rank 0 decides (its timings are the only ones used) and every rank receives the decision, as
the budget planner's profiles are shared. The decision is written to `<run dir>/auto.json`; a
restarted or requeued run with the same settings reads it back instead of timing again, so a
resumed run continues with the micro-batch and plan it started with (a fresh timing could pick
another, and the loss curve would not continue bit for bit).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Optional

import torch
import torch.distributed as dist

from checkpointing.planner.whole_step import Timing
from checkpointing.planner.metatrace import cast_like_fsdp
from checkpointing.plan import BlockPlan
from checkpointing.planner.profile import profile_blocks, trace_on_meta
from checkpointing.wrap import resolve_ops
from offload.apply import offload_dir
from offload.bandwidth import seconds_per_byte
from sharding.fsdp import DTYPES
from trainer.preflight.auto_plan import (GIB, Candidate, Decision, Timer, decide, rest_flops,
                                         with_sequence_costs)
from trainer.build import build_on_meta, find_model_blocks
from sharding.layout import Layout
from trainer.config import Config, ConfigError, tile_count
from trainer.distenv import DistEnv
from trainer.preflight.scenario import (Evaluator, Scenario, one_rank_of_sequence,
                                        rank_share)
from trainer.task import task_for

log = logging.getLogger("trainer")
AUTO_FILE = "auto.json"


def capacity_of(cfg: Config, device: torch.device) -> int:
    """train.memory_gib, else on CUDA the device's total minus train.memory_reserve_gib."""
    t = cfg.train
    if t.memory_gib is not None:
        return int(t.memory_gib * GIB)
    if device.type != "cuda":
        raise ConfigError("train.memory_gib", "needs a value on CPU (the memory one rank may "
                          "use, e.g. train.memory_gib=2); only a CUDA device has a default")
    total = torch.cuda.get_device_properties(device).total_memory
    capacity = total - int(t.memory_reserve_gib * GIB)
    if capacity <= 0:
        raise ConfigError("train.memory_reserve_gib", f"{t.memory_reserve_gib} GiB leaves "
                          f"nothing of the device's {total / GIB:.1f} GiB")
    return capacity


def device_timer(device: torch.device, repeats: int, run_dir: str, rank: int) -> Timer:
    """Times each distinct block at the candidate's shapes on the device (as the budget
    planner's profiles); the rest of the model at the blocks' measured FLOP rate."""
    moved: dict[str, float] = {}

    def timer(cfg: Config, scenario: Scenario, evaluator: Evaluator):
        model = build_on_meta(cfg.model)
        _, blocks = find_model_blocks(model, cfg.model)
        s = cfg.sharding
        if s.mode != "none" and s.param_dtype:  # time what FSDP will run: the compute dtype
            cast_like_fsdp(model, blocks, DTYPES[s.param_dtype])
        # One rank's blocks: its T/N tokens, attention between stand-ins of the all-to-alls
        # (their time is added nominally), MLPs tiled.
        degree = scenario.layout.degree
        one_rank_of_sequence(cfg, model, degree, tile_count(cfg.checkpointing))
        task = task_for(cfg.model, cfg.data, cfg.checkpointing)
        inputs, targets = task.example(cfg.train.micro_batch_size)
        share = rank_share(cfg, degree)
        if share > 1:  # this rank's share of each row (a language model's tokens)
            inputs, targets = (t[:, :t.shape[1] // share] for t in (inputs, targets))
        trace = trace_on_meta(model, blocks, lambda m: task.loss(m, inputs, targets))
        profiles = profile_blocks(blocks, trace, device,
                                  resolve_ops(cfg.checkpointing.save_ops), repeats)
        profile = evaluator.profile(cfg, degree)[0]
        profiles = [dataclasses.replace(p, working_bytes=dict(m.peak_bytes))
                    for p, m in zip(profiles, profile.blocks)]
        compute = sum(p.compute_s for p in profiles)
        block_flops = sum(3 * m.forward_flops - m.frozen_flops for m in profile.blocks)
        rest = rest_flops(cfg, profile, degree) * (compute / block_flops if block_flops else 0.0)
        o = cfg.offload
        per_byte = None
        if evaluator.setup(scenario).offload_min_bytes is not None:
            if o.target not in moved:  # measured once per run
                moved[o.target] = seconds_per_byte(o.target, device,
                                                   offload_dir(o.dir, run_dir, rank))
            per_byte = moved[o.target]
        timing = Timing(tuple(dict(p.cost_s) for p in profiles),
                        tuple(p.compute_s for p in profiles), rest, per_byte)
        # Tiles' extra forward (of the tiled parts) at the blocks' measured FLOP rate; the all-to-alls nominal.
        rate = compute / block_flops if block_flops else 0.0
        return with_sequence_costs(timing, profile, scenario, rate), profiles
    return timer


def _key(cfg: Config, world_size: int, capacity: int) -> dict:
    """What the decision depends on: a restart with other values decides again."""
    t, o = cfg.train, cfg.offload
    return {"world_size": world_size, "capacity": capacity,
            "model": dataclasses.asdict(cfg.model), "seq_len": cfg.data.seq_len,
            "sharding": dataclasses.asdict(cfg.sharding),
            "checkpointing": dataclasses.asdict(cfg.checkpointing),
            "offload": [o.target, o.min_bytes, o.keep_last],
            "train": [t.micro_batch_size, t.global_batch_size, t.grad_accum, t.compile]}


def _read(path: str, key: dict) -> Optional[Decision]:
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("key") != json.loads(json.dumps(key)):
            return None
        d = data["decision"]
        return Decision(d["micro_batch"], d["grad_accum"], [BlockPlan(**p) for p in d["plan"]],
                        d["capacity"], d["peak_bytes"], d["step_s"],
                        [Candidate(**c) for c in d["candidates"]], reused=True,
                        sequence=d.get("sequence", 1), tiles=d.get("tiles", 1),
                        context=d.get("context", 1))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write(path: str, key: dict, decision: Decision) -> None:
    data = dataclasses.asdict(dataclasses.replace(decision, profiles=None))
    data.pop("profiles")
    data.pop("reused")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"key": key, "decision": data}, f, indent=1)
    os.replace(tmp, path)


def run_auto(cfg: Config, layout: Layout, denv: DistEnv, run_dir: str,
            gpus_per_node: int) -> tuple[Config, Layout, Decision]:
    """(the config with what auto chose made concrete, the new layout auto's choice makes, the
    decision). The layout is made anew from the chosen degree and micro-batch, as validation
    makes one: the mesh, each rank's share of the data and the model all follow it."""
    payload: list = [None]
    if denv.rank == 0:
        try:
            capacity = capacity_of(cfg, denv.device)
            key = _key(cfg, denv.world_size, capacity)
            path = os.path.join(run_dir, AUTO_FILE)
            decision = _read(path, key)
            if decision is None:
                evaluator = Evaluator(1.0, optimizer_foreach=denv.device.type == "cuda",
                                      device_type=denv.device.type)
                timer = device_timer(denv.device, cfg.checkpointing.profile_repeats, run_dir,
                                     denv.rank)
                decision = decide(cfg, Scenario(cfg, layout, gpus_per_node), evaluator,
                                  capacity, timer)
                _write(path, key, decision)
            payload = [decision]
        except ConfigError as exc:  # sent as text: the exception's own pickling loses its key
            payload = [(exc.key, str(exc).removeprefix(f"{exc.key}: "))]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], tuple):
        raise ConfigError(*payload[0])
    decision = payload[0]
    decided = layout.decided(decision.sequence, decision.micro_batch, decision.context)
    assert decided.grad_accum == decision.grad_accum, (decided, decision.grad_accum)
    return chosen_config(cfg, decision), decided, decision


def chosen_config(cfg: Config, decision: Decision) -> Config:
    """The config with what `auto` chose made concrete, for the build: the micro-batch, the
    sequence degree, the ring and the tile count (the plan's blocks carry the tiles too)."""
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, micro_batch_size=decision.micro_batch),
        sharding=dataclasses.replace(cfg.sharding, sequence=decision.sequence,
                                     context=decision.context),
        checkpointing=dataclasses.replace(cfg.checkpointing, tiles=decision.tiles))
