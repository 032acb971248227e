"""`python -m checkpointing.head_bench`, kept working: it runs `python -m launch.bench.head`.

The benchmarks live in one room, launch/bench/. This module only hands its arguments over (it
replaces itself with that command), so nothing here imports launch/.
"""

import os
import sys

if __name__ == "__main__":
    os.execv(sys.executable, [sys.executable, "-m", "launch.bench.head", *sys.argv[1:]])
