"""CPU runs fix glibc's heap thresholds (train.cpu_heap=steady, offload/heap.py): a block under
32 MiB comes from the heap and its pages stay after it is freed, where glibc's moving thresholds
would map it afresh and hand it back. A user's MALLOC_* settings win."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from offload.heap import MALLOC_ENV, steady_thresholds
from tests.helpers import REPO, subprocess_env
from tests.test_startup_lean import TINY

# A fresh process (no torch: nothing has moved glibc's thresholds yet) takes and frees one
# 20 MiB block; mallinfo2 says whether it was mapped on its own and what the heap kept after.
_BLOCK = """
import ctypes, json, sys
from offload.heap import steady_thresholds
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype, libc.malloc.restype = Info, ctypes.c_void_p
libc.malloc.argtypes, libc.free.argtypes = [ctypes.c_size_t], [ctypes.c_void_p]
said = steady_thresholds({}) if sys.argv[1] == "steady" else "glibc"
block = libc.malloc(20 << 20)
mapped = libc.mallinfo2().hblkhd
libc.free(block)
print(json.dumps({"said": said, "mapped": mapped, "kept": libc.mallinfo2().keepcost}))
"""


def _block(mode: str) -> dict:
    env = {k: v for k, v in subprocess_env().items() if k not in MALLOC_ENV}
    done = subprocess.run([sys.executable, "-c", _BLOCK, mode], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_steady_thresholds_keep_a_freed_block_in_the_heap() -> None:
    glibc, steady = _block("glibc"), _block("steady")
    if steady["said"] != "fixed":
        pytest.skip(f"not glibc here: {steady['said']}")
    assert glibc["mapped"] >= 20 << 20 and glibc["kept"] < 20 << 20, glibc  # mapped, given back
    assert steady["mapped"] < 20 << 20 and steady["kept"] >= 20 << 20, steady  # heap, kept


@pytest.mark.parametrize("name", MALLOC_ENV)
def test_a_users_malloc_settings_win(name: str) -> None:
    assert steady_thresholds({name: "1"}) == f"left as {name} sets it"


_SPY = """
import atexit, sys
import trainer.loop as loop
calls, real = [], loop.steady_thresholds
loop.steady_thresholds = lambda *a, **k: calls.append(1) or real(*a, **k)
atexit.register(lambda: print("HEAP", len(calls)))
sys.argv = ["trainer", *sys.argv[1:]]
from trainer.__main__ import main
main()
"""


@pytest.mark.parametrize("mode, calls", [("steady", 1), ("glibc", 0)])
def test_a_cpu_run_fixes_them_unless_told_not_to(tmp_path, mode: str, calls: int) -> None:
    done = subprocess.run([sys.executable, "-c", _SPY, *TINY, "train.steps=1", "save.every=0",
                           f"train.cpu_heap={mode}", f"hydra.run.dir={tmp_path}/run"],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"HEAP {calls}" in done.stdout.splitlines()
