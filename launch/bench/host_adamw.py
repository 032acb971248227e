"""The optimizer step sharding.cpu_offload runs on the host: torch's AdamW (as trainer/optim.py
builds it) over fp32 CPU parameters, in elements per second.

    python -m launch.bench.host_adamw [--million 64] [--tensor-million 16] [--threads 1,2]
                                      [--steps 5]

--million M elements in tensors of --tensor-million M each (a large model's shard: matrices of
tens of millions of elements, too large for the caches: with 4 M-element tensors this machine
stepped 2.7 ns an element on 1 thread, with 16 M 6.3; the per-tensor overhead of many small
ones is not in this figure), all
trained with weight decay; one warm-up step, then the median of --steps steps, per thread count
(torch.set_num_threads). The report's step time uses a nominal rate
(trainer/preflight/scenario.py's NOMINAL_HOST_ADAMW_S_PER_ELEMENT) from this benchmark: a rank of
a GPU node has its own share of that host's cores and memory bandwidth, which this machine's
figure does not know. Plain tensors: FSDP2's parameters are DTensors, whose dispatch adds a
per-tensor cost that is not measured here.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def step_seconds(numel: int, tensor_numel: int, threads: int, steps: int) -> float:
    """The median AdamW step over `numel` elements on `threads` threads (the process's thread
    count is left as it was)."""
    was = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _median_step(numel, tensor_numel, steps)
    finally:
        torch.set_num_threads(was)


def _median_step(numel: int, tensor_numel: int, steps: int) -> float:
    sizes = [tensor_numel] * (numel // tensor_numel) + ([numel % tensor_numel]
                                                         if numel % tensor_numel else [])
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=0.1)
    optimizer.step()  # the state is made here: not a steady step
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        optimizer.step()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--million", type=float, default=64.0)
    parser.add_argument("--tensor-million", type=float, default=16.0)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    numel, tensor = int(args.million * 1e6), int(args.tensor_million * 1e6)
    print(f"torch {torch.__version__}, AdamW over {numel / 1e6:,.1f} M fp32 elements on the CPU "
          f"(tensors of {tensor / 1e6:g} M)")
    for threads in (int(t) for t in args.threads.split(",")):
        seconds = step_seconds(numel, tensor, threads, args.steps)
        print(f"threads {threads}: {seconds:.3f} s a step, {numel / seconds / 1e6:,.1f} M "
              f"elements/s, {seconds / numel * 1e9:.2f} ns an element")


if __name__ == "__main__":
    main()
