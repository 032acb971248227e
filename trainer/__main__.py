"""`python -m trainer [group=option ...] [key=value ...]`: the same entry under torchrun.

The command line is composed and validated first (trainer/cli.py): a mistake is one line from
rank 0 and exit status 2, before torch is imported. Only then does Hydra run the job, which gives
run directories, config dumps and `-m` sweeps.
"""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig

from trainer import cli
from trainer.config import ConfigError, register_schema
from trainer.rundir import register_resolver


@hydra.main(config_path="pkg://conf", config_name="config", version_base=None)
def _run(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    try:
        config = cli.to_config(cfg)
        _, world, nodes = cli.world_from_env(os.environ)
        layout = cli.validate(config, world_size=world, num_nodes=nodes)
    except ConfigError as exc:  # reached by `-m` sweeps, which skip the pre-flight check
        cli.report(exc)
        cli.exit_after_error()

    from checkpointing.policies import BudgetError
    from offload.engine import OffloadError
    from trainer.loop import train
    from trainer.faults import CollectiveFailure, FaultLimit
    from trainer.precheck import as_config_error, setting_of
    from trainer.ownership import RunDirBusy
    from trainer.state import CheckpointError

    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    try:
        status = train(config, layout, run_dir=hydra_cfg.runtime.output_dir,
                       keep_process_group=hydra_cfg.mode == RunMode.MULTIRUN)
    except BudgetError as exc:  # known only after profiling the blocks on the device
        cli.report(ConfigError("checkpointing.budget", str(exc)))
        cli.exit_after_error()
    except ConfigError as exc:  # known only once the model is built (e.g. model.freeze)
        cli.report(exc)
        cli.exit_after_error()
    except CheckpointError as exc:  # known only once the checkpoint meets the built model
        cli.report(ConfigError("save.resume", str(exc)))
        cli.exit_after_error()
    except RunDirBusy as exc:  # another live run holds this run directory
        cli.report(ConfigError("train.run_name", str(exc)))
        cli.exit_after_error()
    except (CollectiveFailure, FaultLimit, OffloadError) as exc:
        # Names the rank and the operation, or the setting and what happened: the trace adds
        # nothing. Not a configuration mistake, so not status 2.
        if _debug():
            raise
        if isinstance(exc, CollectiveFailure) or cli.world_from_env(os.environ)[0] == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
    except ValueError as exc:  # our own messages start with the setting to change
        if _debug() or setting_of(str(exc)) is None:
            raise
        cli.report(as_config_error(exc))
        cli.exit_after_error()
    if status:
        sys.exit(status)  # preempted after saving: the launcher may run it again


def _debug() -> bool:
    """HYDRA_FULL_ERROR=1 asks for the whole traceback, as it does for Hydra's own errors."""
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def main() -> None:
    argv = sys.argv[1:]
    if cli.preflight(argv):
        cli.exit_after_error()
    register_schema()
    register_resolver()
    sys.argv = [sys.argv[0]] + cli.hydra_argv(argv)
    _run()
    if "torch.distributed" in sys.modules:  # a sweep kept its process group for all its jobs
        from launch.env import shutdown

        shutdown()


if __name__ == "__main__":
    main()
