"""Wheels for a GPU host without a network: fetch them here, install them there.

The GPU host has torch and the scientific stack but not the config libraries the trainer needs.
`fetch` (on a machine with package access) downloads exactly the versions installed here, for
the host's Python and platform, without dependency resolution; `install` (on the host, offline)
puts them into a private folder that the GPU check puts first on the path of itself and of every
process it starts. Nothing is installed into the host's own environment.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import zipfile
from importlib import metadata
from typing import Mapping, Optional, Sequence

# What the trainer imports that the GPU host lacks (hydra-core pulls in omegaconf, which pulls
# in antlr4's runtime at exactly 4.9.*), and what the check's cuda_tests stage runs the CUDA
# tests with: pytest, with what it imports (pluggy, iniconfig, and packaging and pygments,
# which pytest 9 needs newer than a host may have). Versions are the ones installed here:
# tested together. All pure Python.
HOST_LACKS = ("hydra-core", "omegaconf", "antlr4-python3-runtime", "pytest", "pluggy",
              "iniconfig", "packaging", "pygments")
# antlr4-python3-runtime 4.9.3 is published only as a source archive; it is pure Python, so a
# wheel built from it here installs anywhere.
BUILD_FROM_SOURCE = ("antlr4-python3-runtime",)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def pinned(names: Sequence[str] = HOST_LACKS) -> list[str]:
    """`name==version` of each package as installed in this environment."""
    return [f"{name}=={metadata.version(name)}" for name in names]


def fetch_commands(folder: str, python_version: str = "3.12",
                   names: Sequence[str] = HOST_LACKS) -> list[list[str]]:
    """The pip commands that fill `folder`: binary wheels for the host's Python and platform,
    and locally built wheels of the packages published only as source."""
    pip = [sys.executable, "-m", "pip"]
    commands = []
    for spec in pinned(names):
        name = spec.split("==")[0]
        if name in BUILD_FROM_SOURCE:
            commands.append([*pip, "wheel", "--no-deps", "--wheel-dir", folder, spec])
        else:
            platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
            commands.append([*pip, "download", "--no-deps", "--only-binary=:all:",
                             "--python-version", python_version, "--implementation", "cp",
                             *platforms, "--dest", folder, spec])
    return commands


def fetch(folder: str, python_version: str = "3.12") -> list[str]:
    """Download (or build) the wheels into `folder`; returns the wheel files there."""
    os.makedirs(folder, exist_ok=True)
    for command in fetch_commands(folder, python_version):
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"--fetch-wheels: {' '.join(command[3:])} failed: "
                               f"{(result.stderr.strip().splitlines() or ['?'])[-1]}")
    return sorted(glob.glob(os.path.join(folder, "*.whl")))


def install(folder: str, site: str, use_pip: Optional[bool] = None) -> list[str]:
    """Install every wheel of `folder` into `site`, offline and without dependencies.

    Pure-Python wheels are zip archives laid out as they install; where the host's pip is
    missing they are unpacked directly (the packages here have no compiled parts).
    """
    wheels = sorted(glob.glob(os.path.join(folder, "*.whl")))
    if not wheels:
        raise RuntimeError(f"--wheels {folder}: no .whl files there; make them with "
                           f"python -m launch.gpu_check --fetch-wheels {folder}")
    os.makedirs(site, exist_ok=True)
    if use_pip is None:
        use_pip = subprocess.run([sys.executable, "-m", "pip", "--version"],
                                 capture_output=True).returncode == 0
    if use_pip:
        result = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                                 "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade",
                                 "--disable-pip-version-check", "--target", site, *wheels],
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"installing the wheels of {folder} failed: "
                               f"{(result.stderr.strip().splitlines() or ['?'])[-1]}")
    else:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(site)
    return [os.path.basename(w) for w in wheels]


def use(site: str, repo: str, env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """This process imports from `site` first; returns the environment for child processes,
    which find `site` and the checkout (the project runs from it, no build step)."""
    if site not in sys.path:
        sys.path.insert(0, site)
    env = dict(os.environ if env is None else env)
    paths = list(dict.fromkeys([site, repo] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p]))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env
