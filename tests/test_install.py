"""`pip install .` (not editable) into a fresh venv; `python -m trainer` from any folder works."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig

import pytest

from tests.helpers import REPO, check_ok, losses, subprocess_env


@pytest.mark.slow
def test_non_editable_install_runs_from_another_folder(tmp_path) -> None:
    source = tmp_path / "src"
    tracked = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.split()
    for rel in tracked:
        if (REPO / rel).is_file():
            (source / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, source / rel)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # Dependencies (torch, hydra, ...) come from this test's environment; blocktrain itself is
    # built and installed into the new venv as a regular (non-editable) package.
    with open(f"{site}/deps.pth", "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                              "-q", "--no-deps", "--no-build-isolation", str(source)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = subprocess_env()
    env.pop("PYTHONPATH")
    where = subprocess.run([str(python), "-c", "import trainer, conf; print(trainer.__file__)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True)
    assert where.stdout.startswith(site), where.stdout + where.stderr
    run = subprocess.run([str(python), "-m", "trainer", "train.steps=2", "logging.wandb=false",
                          "data.seq_len=32", "train.micro_batch_size=2", "hydra.run.dir=run",
                          "data.max_corpus_bytes=1000000"],
                         cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    check_ok(run)
    assert len(losses(elsewhere / "run")) == 1  # logging.every=10: the last step only
