"""A real 2-node Slurm cluster on this machine, for the launcher's tests.

Debian's slurmctld, slurmd and munge: one controller and two slurmd daemons (`-N n1`, `-N n2`)
on distinct ports, all on 127.0.0.1. The configuration lives in its own folder and is selected
with SLURM_CONF, so a Slurm already configured on the machine (/etc/slurm) is never touched.
Needs root (slurmd runs jobs as their user) and the packages (.ci/run installs them);
`unavailable()` says why not otherwise, and the tests skip with that reason.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Optional

NODES = ("n1", "n2")
CTLD_PORT, NODE_PORTS = 16817, (17001, 17002)
MUNGE_KEY = Path("/etc/munge/munge.key")
BINARIES = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "squeue", "scancel")


def unavailable() -> Optional[str]:
    missing = [b for b in BINARIES if shutil.which(b) is None
               and not os.path.exists(f"/usr/sbin/{b}")]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing; .ci/run installs "
                "slurmctld slurmd munge slurm-client with apt)")
    if os.geteuid() != 0:
        return "the test Slurm cluster runs its daemons as root; not root here"
    return None


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _config(root: Path, cpus: int) -> str:
    host = socket.gethostname()
    nodes = "\n".join(
        f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} "
        "RealMemory=4000 State=UNKNOWN" for name, port in zip(NODES, NODE_PORTS))
    return f"""# blocktrain test cluster (tests/slurm_cluster.py)
ClusterName=blocktrain-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={CTLD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job may start again only after its old credentials expire (default 120 s).
AuthInfo=cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=5
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmdPidFile={root}/slurmd-%n.pid
SlurmdLogFile={root}/slurmd-%n.log
SlurmctldPidFile={root}/slurmctld.pid
SlurmctldLogFile={root}/slurmctld.log
{nodes}
PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class LocalSlurm:
    """Start with `start()`, end with `stop()`; `env` holds SLURM_CONF for client commands."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._started_munge = False

    def _run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True,
                              timeout=60, check=check)

    def start(self) -> None:
        for sub in ("state", "spool/n1", "spool/n2"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(_config(self.root, os.cpu_count() or 2))
        self._ensure_hosts()
        self._ensure_munge()
        self._run(_binary("slurmctld"), "-f", str(self.conf))
        for name in NODES:
            self._run(_binary("slurmd"), "-f", str(self.conf), "-N", name)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            states = self._run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split()
            if states.count("idle") == len(NODES):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the test cluster did not come up: {self._run('sinfo', check=False)}"
                           f"\n{(self.root / 'slurmctld.log').read_text()[-2000:]}")

    def _ensure_hosts(self) -> None:
        """slurmd -N n1 looks its node name up; the names must resolve (to this machine)."""
        hosts = Path("/etc/hosts")
        text = hosts.read_text()
        missing = [n for n in NODES if not any(line.split()[1:].count(n)
                                               for line in text.splitlines() if line.strip())]
        if missing:
            with open(hosts, "a") as f:
                f.write("".join(f"127.0.0.1 {n}\n" for n in missing))

    def _ensure_munge(self) -> None:
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0:
            return
        for folder in ("/etc/munge", "/var/log/munge", "/run/munge", "/var/lib/munge"):
            os.makedirs(folder, exist_ok=True)
            shutil.chown(folder, "munge", "munge")
        if not MUNGE_KEY.exists():
            MUNGE_KEY.write_bytes(os.urandom(1024))
        shutil.chown(MUNGE_KEY, "munge", "munge")
        MUNGE_KEY.chmod(0o400)
        os.chmod("/etc/munge", 0o700)
        subprocess.run(["runuser", "-u", "munge", "--", _binary("munged")], check=True,
                       timeout=30)
        self._started_munge = True

    def stop(self) -> None:
        self._run("scancel", "--full", "--user=root", check=False)
        pid_files = [self.root / f"slurmd-{n}.pid" for n in NODES] + [self.root / "slurmctld.pid"]
        for pid_file in pid_files:
            try:
                os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
            except (OSError, ValueError):
                pass
        if self._started_munge:
            subprocess.run(["pkill", "-x", "munged"], capture_output=True)

    def job_state(self, job_id: str) -> tuple[str, int]:
        """(state, restarts) of a job, e.g. ("RUNNING", 0)."""
        out = self._run("scontrol", "show", "job", job_id, "-o", check=False).stdout
        fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
        return fields.get("JobState", "UNKNOWN"), int(fields.get("Restarts", "0"))
