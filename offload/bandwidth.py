"""Measured cost of moving bytes to the offload target and back, for the planner."""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np
import torch


def seconds_per_byte(target: str, device: torch.device, directory: str,
                     nbytes: int = 32 << 20) -> float:
    """Seconds to move one byte out and back again; 0.0 when nothing would move."""
    if target == "cpu":
        if device.type != "cuda":
            return 0.0  # the CPU is the compute device: the cpu target moves nothing
        source = torch.empty(nbytes, dtype=torch.uint8, device=device)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        host.copy_(source, non_blocking=True)
        source.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        return (time.perf_counter() - started) / nbytes
    if target == "disk":
        os.makedirs(directory, exist_ok=True)
        data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        fd, path = tempfile.mkstemp(prefix=".bandwidth-", dir=directory)
        os.close(fd)
        try:
            started = time.perf_counter()
            data.tofile(path)
            back = np.fromfile(path, dtype=np.uint8)
            elapsed = time.perf_counter() - started
        finally:
            os.unlink(path)
        assert back.nbytes == nbytes
        return elapsed / nbytes
    raise ValueError(f"offload.target={target!r}: no bandwidth to measure")
