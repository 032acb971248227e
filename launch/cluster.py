"""What the Slurm cluster offers, read with `scontrol`, and whether a job request fits it.

Checked before submission, so a request the cluster can never run (more nodes than the partition
has, more GPUs per node than any node has, a time over the partition's limit) is one clear error
instead of a job that pends forever.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Optional

from trainer.config import ConfigError

_FIELD = re.compile(r"(?:^|(?<=\s))([A-Za-z][\w/.:]*)=")


def parse_records(text: str) -> list[dict[str, str]]:
    """`scontrol show <entity> -o` output: one record a line of KEY=VALUE fields. Values may
    contain spaces (e.g. OS=Linux 6.1 #1 SMP), so a field runs up to the next KEY=."""
    records = []
    for line in text.splitlines():
        matches = list(_FIELD.finditer(line))
        record = {}
        for i, match in enumerate(matches):
            end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
            record[match.group(1)] = line[match.end():end].strip()
        if record:
            records.append(record)
    return records


def gpu_count(gres: str) -> int:
    """GPUs in a node's Gres: "gpu:8", "gpu:h100:8(S:0-1)", "gpu:a100:4,gpu:v100:2", "(null)"."""
    total = 0
    for item in gres.split(","):
        parts = re.sub(r"\(.*?\)", "", item).split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def parse_time(text: str) -> Optional[int]:
    """Seconds in a Slurm time ("MM", "MM:SS", "HH:MM:SS", "D-HH", "D-HH:MM", "D-HH:MM:SS");
    None for UNLIMITED/INFINITE. Raises ValueError on anything else."""
    text = text.strip()
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return None
    days, sep, rest = text.partition("-")
    if not sep:
        days, rest = "0", text
    fields = rest.split(":")
    if not days.isdigit() or not all(f.isdigit() for f in fields) or len(fields) > 3:
        raise ValueError(f"{text!r} is not a Slurm time (MM, HH:MM:SS, D-HH:MM, ...)")
    values = [int(f) for f in fields]
    if sep or len(values) == 3:  # D-HH[:MM[:SS]] or HH:MM:SS
        hours, minutes, seconds = values + [0] * (3 - len(values))
    else:  # MM or MM:SS
        hours, (minutes, seconds) = 0, (values + [0])[:2]
    return ((int(days) * 24 + hours) * 60 + minutes) * 60 + seconds


@dataclass
class Partition:
    name: str
    default: bool
    total_nodes: int
    max_nodes: Optional[int]
    max_time_s: Optional[int]


@dataclass
class Node:
    name: str
    cpus: int
    gpus: int
    partitions: list[str]


@dataclass
class Cluster:
    partitions: list[Partition]
    nodes: list[Node]

    def partition(self, name: Optional[str]) -> Partition:
        for p in self.partitions:
            if (name is None and p.default) or p.name == name:
                return p
        names = ", ".join(p.name for p in self.partitions) or "none"
        if name is None:
            raise ConfigError("--partition", f"the cluster has no default partition; choose one "
                                             f"of {names}")
        raise ConfigError("--partition", f"{name}: no such partition; choose one of {names}")

    def nodes_of(self, partition: str) -> list[Node]:
        return [n for n in self.nodes if partition in n.partitions]


def _unlimited_or_int(value: str) -> Optional[int]:
    return None if value.upper() in ("UNLIMITED", "INFINITE", "") else int(value)


def from_scontrol(partitions_text: str, nodes_text: str) -> Cluster:
    partitions = [Partition(r["PartitionName"], r.get("Default") == "YES",
                            int(r.get("TotalNodes", "0")),
                            _unlimited_or_int(r.get("MaxNodes", "UNLIMITED")),
                            parse_time(r.get("MaxTime", "UNLIMITED")))
                  for r in parse_records(partitions_text) if "PartitionName" in r]
    nodes = [Node(r["NodeName"], int(r.get("CPUTot", "0")), gpu_count(r.get("Gres", "")),
                  [p for p in r.get("Partitions", "").split(",") if p])
             for r in parse_records(nodes_text) if "NodeName" in r]
    return Cluster(partitions, nodes)


def slurm_available() -> bool:
    return shutil.which("scontrol") is not None and shutil.which("sbatch") is not None


def query() -> Cluster:
    """The cluster as the controller describes it; a usage error if it cannot be reached."""
    texts = []
    for entity in ("partition", "node"):
        try:
            result = subprocess.run(["scontrol", "show", entity, "-o"], capture_output=True,
                                    text=True, timeout=60)
        except FileNotFoundError as exc:
            raise ConfigError("slurm", "scontrol is not on PATH; run this on a machine of the "
                                       "cluster (e.g. a login node)") from exc
        if result.returncode != 0:
            reason = (result.stderr or result.stdout).strip().splitlines()
            raise ConfigError("slurm", "cannot read the cluster with `scontrol show "
                              f"{entity}`: {reason[0] if reason else 'no output'}")
        texts.append(result.stdout)
    return from_scontrol(*texts)


def check_request(cluster: Cluster, partition: Optional[str], nodes: int, gpus_per_node: int,
                  cpus_per_task: Optional[int], time_s: Optional[int]) -> str:
    """Raise ConfigError naming the flag if the request can never run; else a one-line summary
    of the partition it will run on."""
    part = cluster.partition(partition)
    members = cluster.nodes_of(part.name)
    total = part.total_nodes or len(members)
    if nodes > total:
        raise ConfigError("--nodes", f"{nodes} nodes, but partition {part.name} has {total}")
    if part.max_nodes is not None and nodes > part.max_nodes:
        raise ConfigError("--nodes", f"{nodes} nodes, but partition {part.name} allows at most "
                                     f"{part.max_nodes} per job")
    if gpus_per_node:
        fitting = [n for n in members if n.gpus >= gpus_per_node]
        most = max((n.gpus for n in members), default=0)
        if len(fitting) < nodes:
            have = f"at most {most}" if most else "none"
            raise ConfigError("--gpus-per-node", f"{gpus_per_node} GPUs per node on {nodes} "
                              f"nodes, but nodes of partition {part.name} have {have} "
                              f"({len(fitting)} nodes have {gpus_per_node})")
    if cpus_per_task:
        fitting = [n for n in members if n.cpus >= cpus_per_task]
        if len(fitting) < nodes:
            most = max((n.cpus for n in members), default=0)
            raise ConfigError("--cpus-per-task", f"{cpus_per_task} CPUs per node, but nodes of "
                                                 f"partition {part.name} have at most {most}")
    if time_s is not None and part.max_time_s is not None and time_s > part.max_time_s:
        raise ConfigError("--time", f"{time_s} s, but partition {part.name} allows at most "
                                    f"{part.max_time_s} s")
    gpus = sorted({n.gpus for n in members})
    cpus = sorted({n.cpus for n in members})
    limit = "unlimited" if part.max_time_s is None else f"{part.max_time_s} s"
    return (f"partition {part.name}: {total} nodes, {'/'.join(map(str, cpus))} CPUs and "
            f"{'/'.join(map(str, gpus))} GPUs per node, time limit {limit}")
