"""What a run does not pay for before it needs it: DCP's import comes with the first save (or a
resume that loads), not with start-up (issue 28); numpy's masked arrays never come. The
checkpointer's gloo group does come with start-up, once: making a group needs the rendezvous
store, which dies with the torchrun agent, and a stop must still save after that
(tests/test_stopping.py)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import REPO, subprocess_env

TINY = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.ffn_hidden=64", "model.vocab_size=64", "data=synthetic", "data.seq_len=16",
        "train.micro_batch_size=2", "train.steps=4", "logging.wandb=false",
        "logging.progress=false", "save.every=2", "save.at_end=false"]

# Records, at the end of every optimizer step, whether DCP is imported and how many process
# groups the run has made since start-up (the checkpointer's is made through dist.new_group).
_SPY = """
import atexit, json, sys
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook
made, seen = [], []
real = dist.new_group
def new_group(*args, **kwargs):
    made.append(kwargs.get("backend"))
    return real(*args, **kwargs)
dist.new_group = new_group
register_optimizer_step_post_hook(lambda *a: seen.append(
    {"dcp": "torch.distributed.checkpoint" in sys.modules, "groups": list(made),
     "numpy.ma": "numpy.ma" in sys.modules}))
atexit.register(lambda: print("SEEN", json.dumps(seen)))
sys.argv = ["trainer", *sys.argv[1:]]
from trainer.__main__ import main
main()
"""


def _steps(tmp_path, *extra: str) -> list[dict]:
    done = subprocess.run([sys.executable, "-c", _SPY, *TINY, f"hydra.run.dir={tmp_path}/run",
                           *extra], cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("SEEN ")][-1]
    seen = json.loads(line.removeprefix("SEEN "))
    # Reading batches must not pull in numpy's masked arrays (np.unique does: 1.3 MiB a rank).
    assert not any(step.pop("numpy.ma") for step in seen), seen
    return seen


def test_dcp_comes_with_the_first_save_and_the_save_group_with_start_up(tmp_path) -> None:
    steps = _steps(tmp_path)
    assert len(steps) == 4
    # Steps 1 and 2 run before the first save (it follows step 2's update and its post-hook).
    assert steps[0] == {"dcp": False, "groups": ["gloo"]} == steps[1], steps
    assert steps[2] == {"dcp": True, "groups": ["gloo"]} == steps[3], steps  # made once
    # A resume that finds the checkpoint loads it before the first step: both come at once.
    # (Loading an optimizer's state makes DCP take one empty step first: one record more.)
    resumed = _steps(tmp_path, "train.steps=6")
    assert resumed[-2:] == [{"dcp": True, "groups": ["gloo"]}] * 2, resumed
