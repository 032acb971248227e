"""Command-line front door: compose and validate the config before anything starts.

Hydra reports its own composition errors as several lines, once per process. We compose the same
overrides first with Hydra's compose API, turn any error into one line that names the key, print
it from rank 0 only and exit with status 2, before torch is imported or a process group exists.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from typing import Any, Mapping, Optional, Sequence, get_type_hints

from trainer.config import Config, ConfigError, register_schema  # noqa: F401
from sharding.layout import Layout
from trainer.data.demo import DEMO
from trainer.data.factory import source_of
from trainer.models.families import family_of
from trainer.validate import check_writable, validate  # noqa: F401
from trainer.state.rundir import register_resolver

USAGE_ERROR = 2
_HYDRA_FLAGS_WITHOUT_RUN = ("--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c",
                            "--shell-completion", "-sc", "--resolve", "-p", "--package")
_MULTIRUN_FLAGS = ("--multirun", "-m")
_HELP_FLAGS = ("--help", "-h")

# What blocktrain adds, said first by `python -m trainer --help` and `python -m launch.run --help`
# (Hydra's and torchrun's own help follow).
EXIT_STATUSES = """\
exit statuses (one process, and a group started with `python -m launch.run`):
  0    finished
  1    a fault that is not a setting (NaN or rollback limits, a collective timed out, a worker
       killed by a signal)
  2    a configuration mistake: one line naming the setting, before anything starts
  74   a checkpoint could not be written (a full disk); the last good step is named
  75   stopped after a committed save (preemption, SIGTERM, train.stop_at_step): start it again
  130  Ctrl-C: saved (first Ctrl-C) or stopped at once (second)"""
RUNS = """\
where runs go: train.out_dir/<run id> (default outputs/), the same on every rank and node; the
run id is train.run_name, else slurm-<job id>, torchrun-<rendezvous id>, or the start time and
pid. Starting a run again in its directory resumes from its newest committed checkpoint
(save.resume=true). Then: python -m trainer.export RUN_DIR (a folder transformers loads) and
python -m trainer.generate RUN_DIR --prompt TEXT | --chat (talk to the model)."""
GROUPS = """\
config groups (group=option; Hydra lists their options below) and any key=value:
  model          the network: tiny and llama_* (built-in Llama), hf (any Hugging Face causal LM:
                 model.path or model.hf_config), vit_*, hf_vision, timm (image classifiers)
  data           what it reads: bytes (the default demo), tokens, synthetic, text and chat
                 (data.path=<jsonl, parquet, dataset>, or data.path=demo), images
  sharding       fsdp, hsdp or none; sharding.sequence for long sequences
  checkpointing  each block's recompute plan: none, full, selective, every_k, sqrt, budget, auto
  offload        saved activations to cpu or disk
  train, optim, save, logging, faults   steps and batch, AdamW, checkpoints and resume, console
                 and W&B, NaN and rollback limits
  precision      dtype presets per model and sharding (chosen by themselves)"""
HELP = f"""\
blocktrain: one plan per block (shard, recompute, offload) for models that do not fit as they
are. python -m trainer [group=option ...] [key=value ...]; torchrun or python -m launch.run
--nproc-per-node N -m trainer ... for more processes; -m for a sweep; --cfg job prints the config;
--help prints this.

{GROUPS}

{EXIT_STATUSES}

{RUNS}

Hydra's own help follows (--hydra-help: Hydra's flags).
"""


def world_from_env(env: Mapping[str, str]) -> tuple[int, int, int]:
    """(rank, world size, number of nodes) as torchrun will give them; (0, 1, 1) for one process."""
    rank = int(env.get("RANK", "0"))
    world = int(env.get("WORLD_SIZE", "1"))
    local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    return rank, world, max(1, world // max(1, local_world))


def _options(group: str) -> list[str]:
    from importlib.resources import files

    folder = files("conf").joinpath(group)
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def _first_line(text: str) -> str:
    return next((line.strip() for line in str(text).splitlines() if line.strip()), "")


def _unknown_key(key: str) -> str:
    from dataclasses import is_dataclass

    parent, _, _ = key.rpartition(".")
    node: object = Config
    for part in parent.split(".") if parent else []:
        node = get_type_hints(node).get(part)  # type: ignore[arg-type]
        if not is_dataclass(node):
            return f"{key}: unknown key"
    valid = ", ".join(get_type_hints(node))  # type: ignore[arg-type]
    where = f"under {parent}" if parent else "at the top level"
    return f"{key}: unknown key; valid keys {where}: {valid}"


def describe_compose_error(exc: BaseException) -> str:
    """One line for a Hydra/OmegaConf composition error, naming the key and what is allowed."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    missing = re.search(r"Could not find '([\w.]+)/([^']+)'", str(exc))
    if isinstance(exc, MissingConfigException) and missing:
        group, name = missing.groups()
        return f"{group}={name}: unknown {group}; choose one of {', '.join(_options(group))}"
    if isinstance(exc, OverrideParseException):
        return f"cannot parse the command line: {_first_line(exc)}"
    cause: Optional[BaseException] = exc
    while cause is not None and not isinstance(cause, OmegaConfBaseException):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
        return _unknown_key(cause.full_key)
    if cause is not None and getattr(cause, "full_key", None):
        return f"{cause.full_key}: {_first_line(cause.msg)}"
    return _first_line(exc) or type(exc).__name__


def _check_known_keys(cfg, schema: type, prefix: str = "") -> None:
    """`+key=value` gets past Hydra's struct mode; an unknown key is still a mistake here."""
    from dataclasses import is_dataclass

    known = get_type_hints(schema)
    for key in cfg.keys():
        if key not in known:
            raise ConfigError("config", _unknown_key(prefix + str(key)))
        sub = known[key]
        if is_dataclass(sub):
            _check_known_keys(cfg[key], sub, prefix + f"{key}.")


@functools.lru_cache(maxsize=8)
def composed(overrides: tuple[str, ...]):
    """Hydra's composition of a command line, its `hydra` node (the run directory) included.
    Memoised, as the pre-flight check and the run directory's claim read the same one (each
    composition is ~0.1 s of start-up); callers do not modify it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    register_schema()
    register_resolver()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module="conf", version_base=None):
            return hydra_compose(config_name="config", overrides=list(overrides),
                                 return_hydra_config=True)
    finally:
        GlobalHydra.instance().clear()


def compose(overrides: Sequence[str]) -> Config:
    """The typed config these overrides produce, or ConfigError / a Hydra exception."""
    import copy

    from omegaconf import open_dict

    cfg = copy.deepcopy(composed(tuple(overrides)))
    with open_dict(cfg):
        del cfg["hydra"]
    return to_config(cfg)


def to_config(cfg) -> Config:
    from omegaconf import OmegaConf

    _check_known_keys(cfg, Config)
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, Config):  # composed without the schema: refuse rather than guess
        raise ConfigError("defaults", "the config must start from the `schema` defaults entry")
    if obj.data.path == DEMO:  # the files the rest of the run reads, made on first use
        try:
            own = family_of(obj.model).own_tokenizer(obj.model)
            obj.data = source_of(obj.data).with_demo(obj.data, own)
        except ConfigError:  # a wrong model.arch or data.source: validate() says so
            pass
    return obj


def check(overrides: Sequence[str], env: Mapping[str, str],
          local_gpus: bool = True) -> tuple[Config, Layout]:
    """Compose and validate; raises ConfigError with a one-line message on any user mistake.

    local_gpus: also check train.device=cuda against this machine's GPUs (off when validating a
    job for other machines, e.g. a Slurm submission from a login node).
    """
    _, world, nodes = world_from_env(env)
    try:
        cfg = compose(overrides)
    except ConfigError:
        raise
    except Exception as exc:  # Hydra and OmegaConf raise many types; all are user input here
        raise ConfigError("config", describe_compose_error(exc)) from exc
    layout = validate(cfg, world_size=world, num_nodes=nodes)
    if local_gpus:  # this machine runs it: its GPUs and its run directory
        if cfg.train.device == "cuda":
            _check_gpus(int(env.get("LOCAL_WORLD_SIZE", str(world))))
        for key in ("hydra.run.dir", "hydra.sweep.dir"):
            run_dir = next((o.split("=", 1)[1] for o in overrides
                            if o.startswith(key + "=")), None)
            if run_dir:
                check_writable(run_dir, key)
        check_writable(cfg.train.out_dir, "train.out_dir")
    return cfg, layout


def _check_gpus(local_world_size: int) -> None:
    import torch  # only when asked for CUDA: every other check stays torch-free and instant

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError("train.device", "cuda, but no CUDA device is visible; use "
                          "train.device=cpu or auto")
    if local_world_size > count:
        raise ConfigError("train.device", f"cuda with {local_world_size} processes per node but "
                          f"{count} GPUs; set torchrun --nproc-per-node to at most {count}")


def expand_sweep(overrides: Sequence[str]) -> list[list[str]]:
    """The jobs of a Hydra sweep, as Hydra's basic sweeper orders them: `a=1,2 b=x,y` gives
    [a=1 b=x], [a=1 b=y], [a=2 b=x], [a=2 b=y]. A plain command line is one job."""
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as exc:
        raise ConfigError("config", describe_compose_error(exc)) from exc
    choices = []
    for override in parsed:
        if override.is_sweep_override():
            key = override.get_key_element()
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            choices.append([override.input_line])
    return [list(job) for job in itertools.product(*choices)]


def check_command(argv: Sequence[str], env: Mapping[str, str] = os.environ) -> int:
    """0 when the command line is good (or is a Hydra flag we leave to Hydra), else 2.

    A `-m` sweep is checked job by job before the first one starts: a typo in the last job must
    not surface hours into the sweep.
    """
    if any(a in _HYDRA_FLAGS_WITHOUT_RUN for a in argv):
        return 0
    overrides = [a for a in argv if not a.startswith("-")]
    try:
        jobs = expand_sweep(overrides) if any(a in _MULTIRUN_FLAGS for a in argv) else [overrides]
        for job in jobs:
            cfg, layout = check(job, env)
            # may import torch: after the quick checks
            from trainer.preflight.precheck import deep_check

            _, world, nodes = world_from_env(env)
            deep_check(cfg, layout, max(1, world // nodes))
    except ConfigError as exc:
        print_error(exc, env)
        return USAGE_ERROR
    return 0


# A launcher (torchrun, srun --kill-on-bad-exit) kills the other workers as soon as one fails. If
# a silent rank failed first, rank 0 could be killed before printing the one error line; the
# silent ranks therefore fail a moment later, normally after rank 0 has already ended the job.
SILENT_RANK_EXIT_DELAY_S = 3.0


def exit_after_error(env: Mapping[str, str] = os.environ) -> None:
    rank, _, _ = world_from_env(env)
    if rank != 0:
        import time

        time.sleep(SILENT_RANK_EXIT_DELAY_S)
    sys.exit(USAGE_ERROR)


def print_error(exc: ConfigError, env: Mapping[str, str] = os.environ) -> None:
    """The one line a config mistake prints, `error: ...`, on rank 0 only (no traceback)."""
    rank, _, _ = world_from_env(env)
    if rank == 0:
        message = str(exc)
        if message.startswith("config: "):
            message = message[len("config: "):]
        print(f"error: {message}", file=sys.stderr, flush=True)


def run_dir_of(argv: Sequence[str]) -> Optional[tuple[str, str]]:
    """(the run directory Hydra will use, the setting that names it) for a single run; None
    for a sweep, a Hydra flag, or a directory that cannot be resolved before Hydra runs."""
    if any(a in _MULTIRUN_FLAGS or a in _HYDRA_FLAGS_WITHOUT_RUN for a in argv):
        return None
    overrides = [a for a in argv if not a.startswith("-")]
    try:
        run_dir = str(composed(tuple(overrides)).hydra.run.dir)
    except Exception:  # e.g. a resolver only Hydra's run registers: its own check, later
        return None
    named = any(o.startswith("hydra.run.dir=") for o in overrides)
    return os.path.abspath(run_dir), "hydra.run.dir" if named else "train.run_name"


def single_run(argv: Sequence[str], env: Mapping[str, str] = os.environ):
    """(the job's config, its run directory) for a single run of plain overrides, set up as
    Hydra's own run sets one up: the run directory made, the config, Hydra's node and the
    overrides dumped in `.hydra/` (rank 0), job logging to the console and `train.log` (rank 0;
    errors only elsewhere). None for anything Hydra must run itself: a sweep, a flag (`--cfg`,
    `--help`, `-m`), `hydra.mode=MULTIRUN`, or a command line that does not compose.

    Why not `@hydra.main` here: it composes the config twice more (once to read `hydra.mode`,
    once for the run: 0.3-0.4 s each of every start and requeue, 2026-12-02) after the pre-flight
    check composed it, and Hydra has no public way to hand it a composed config. This is the
    same setup from Hydra's public pieces (`HydraConfig`, `configure_log`) on the composition the
    pre-flight check made: one composition a start."""
    if any(a.startswith("-") for a in argv):
        return None
    import copy

    from hydra.core.hydra_config import HydraConfig
    from hydra.core.utils import configure_log, setup_globals
    from omegaconf import OmegaConf, open_dict, read_write

    try:
        config = copy.deepcopy(composed(tuple(argv)))
    except Exception:  # Hydra's own run reports it
        return None
    if config.hydra.mode is not None and str(config.hydra.mode) != "RunMode.RUN":
        return None
    setup_globals()  # the `now` and `hydra` resolvers a config may use, as Hydra's run has them
    run_dir = os.path.abspath(str(config.hydra.run.dir))
    with read_write(config.hydra.runtime), open_dict(config.hydra.runtime):
        config.hydra.runtime.output_dir = run_dir
    HydraConfig.instance().set_config(config)
    os.makedirs(run_dir, exist_ok=True)
    main_rank = world_from_env(env)[0] == 0
    logging_config = config.hydra.job_logging if main_rank else OmegaConf.create(
        {"version": 1, "root": {"level": "ERROR"}, "disable_existing_loggers": True})
    configure_log(logging_config, config.hydra.verbose)
    job = copy.deepcopy(config)
    with read_write(job), open_dict(job):
        del job["hydra"]
    if main_rank and config.hydra.output_subdir is not None:
        dump = os.path.join(run_dir, str(config.hydra.output_subdir))
        os.makedirs(dump, exist_ok=True)
        for name, node in (("config.yaml", job), ("hydra.yaml", OmegaConf.masked_copy(
                config, "hydra")), ("overrides.yaml", config.hydra.overrides.task)):
            with open(os.path.join(dump, name), "w", encoding="utf-8") as f:
                f.write(OmegaConf.to_yaml(node))
    os.environ.update({str(k): str(v) for k, v in config.hydra.job.env_set.items()})
    if config.hydra.job.chdir:  # as Hydra's run does when asked (conf/config.yaml: false)
        os.chdir(run_dir)
    return job, run_dir


def hydra_argv(argv: Sequence[str], env: Mapping[str, str] = os.environ) -> list[str]:
    """Hydra's own arguments; other ranks write no config dump and no log file."""
    rank, _, _ = world_from_env(env)
    extra = []
    if rank != 0:
        extra = ["hydra.output_subdir=null", "hydra/job_logging=disabled",
                 "hydra/hydra_logging=disabled"]
    return list(argv) + extra
