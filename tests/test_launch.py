"""The Slurm launcher without a cluster: the script it writes (run through bash), the checks it
makes against a described cluster, sweeps, and the environment defaults."""

from __future__ import annotations

import os
import subprocess

import pytest

import launch.slurm as slurm
from launch.cluster import check_request, from_scontrol, gpu_count, parse_records, parse_time
from launch.cluster_env import DEFAULTS, export_lines, merged
from launch.sbatch import SETTINGS_END, TEMPLATE, template_parts

# A GPU cluster as `scontrol show partition -o` / `show node -o` print it.
PARTITIONS = (
    "PartitionName=gpu AllowGroups=ALL Default=YES MaxNodes=2 MaxTime=2-00:00:00 Nodes=g[1-3] "
    "State=UP TotalCPUs=192 TotalNodes=3\n"
    "PartitionName=cpu Default=NO MaxNodes=UNLIMITED MaxTime=UNLIMITED Nodes=c1 TotalNodes=1\n")
NODES = "".join(
    f"NodeName={name} Arch=x86_64 CPUTot={cpus} Gres={gres} NodeAddr=10.0.0.{i} "
    f"OS=Linux 6.1.0 #1 SMP PREEMPT_DYNAMIC Partitions={part} State=IDLE\n"
    for i, (name, cpus, gres, part) in enumerate([
        ("g1", 64, "gpu:h100:8(S:0-1)", "gpu"), ("g2", 64, "gpu:h100:8(S:0-1)", "gpu"),
        ("g3", 64, "gpu:h100:4", "gpu"), ("c1", 32, "(null)", "cpu")]))


def test_scontrol_records_keep_values_with_spaces() -> None:
    node = parse_records(NODES)[0]
    assert node["OS"] == "Linux 6.1.0 #1 SMP PREEMPT_DYNAMIC"
    assert node["Gres"] == "gpu:h100:8(S:0-1)" and node["Partitions"] == "gpu"
    assert [gpu_count(g) for g in ("gpu:8", "gpu:a100:4,gpu:v100:2", "(null)", "mps:100")] == \
        [8, 6, 0, 0]


@pytest.mark.parametrize("text,seconds", [("30", 1800), ("30:15", 1815), ("04:00:00", 14400),
                                          ("1-00", 86400), ("1-02:30", 95400),
                                          ("2-01:02:03", 176523), ("UNLIMITED", None)])
def test_slurm_times(text, seconds) -> None:
    assert parse_time(text) == seconds


def test_bad_slurm_time_is_refused() -> None:
    with pytest.raises(ValueError, match="not a Slurm time"):
        parse_time("4h")


def test_requests_are_checked_against_the_cluster() -> None:
    cluster = from_scontrol(PARTITIONS, NODES)
    summary = check_request(cluster, None, 2, 8, 64, 3600)
    assert summary == ("partition gpu: 3 nodes, 64 CPUs and 4/8 GPUs per node, time limit "
                       "172800 s")
    refusals = {
        (None, 3, 8, None, None): "--nodes: 3 nodes, but partition gpu allows at most 2 per job",
        ("cpu", 2, 0, None, None): "--nodes: 2 nodes, but partition cpu has 1",
        (None, 2, 16, None, None): "--gpus-per-node: 16 GPUs per node on 2 nodes, but nodes of "
                                   "partition gpu have at most 8 (0 nodes have 16)",
        ("cpu", 1, 1, None, None): "--gpus-per-node: 1 GPUs per node on 1 nodes, but nodes of "
                                   "partition cpu have none (0 nodes have 1)",
        (None, 1, 8, 128, None): "--cpus-per-task: 128 CPUs per node, but nodes of partition "
                                 "gpu have at most 64",
        (None, 1, 8, None, 3 * 86400): "--time: 259200 s, but partition gpu allows at most "
                                       "172800 s",
        ("a100", 1, 0, None, None): "--partition: a100: no such partition; choose one of gpu, cpu",
    }
    for args, message in refusals.items():
        with pytest.raises(Exception) as caught:
            check_request(cluster, *args)
        assert str(caught.value) == message, args


def _dry_run(monkeypatch, capsys, tmp_path, *argv: str) -> str:
    monkeypatch.setattr(slurm, "slurm_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    assert slurm.main(["--dry-run", *argv]) == 0
    return capsys.readouterr().out


def _bash(script: str, *lines: str, env: dict = {}) -> str:
    """Run the script's settings block (no sbatch, no srun) plus `lines` in bash."""
    settings = script[:script.index(SETTINGS_END)]
    full_env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "4242", **env}
    result = subprocess.run(["bash", "-c", settings + "\n" + "\n".join(lines)], env=full_env,
                            capture_output=True, text=True, check=True)
    return result.stdout


def test_dry_run_script_carries_the_request_and_the_exact_overrides(monkeypatch, capsys,
                                                                     tmp_path) -> None:
    tricky = "data.train_path='/data/my corpus/$HOME.bin'"  # quoted for Hydra; kept verbatim
    script = _dry_run(monkeypatch, capsys, tmp_path, "--nodes", "2", "--gpus-per-node", "8",
                      "--time", "04:00:00", "--partition", "gpu", "--signal-lead", "600",
                      "--", "train.device=cuda", "save.signal=SIGUSR2", tricky,
                      "train.out_dir=runs")
    header = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    for option in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8", "--time=04:00:00",
                   "--partition=gpu", "--requeue", "--open-mode=append", "--signal=USR2@600",
                   f"--chdir={tmp_path}", f"--output={tmp_path}/runs/slurm-%x-%j.out"):
        assert f"#SBATCH {option}" in header
    out = _bash(script, 'printf "%s\\n" "${TRAINER_ARGS[@]}"', 'echo "$RUN_DIR $NPROC_PER_NODE '
                '$PREEMPT_SIGNAL $RDZV_PORT"')
    assert out.splitlines() == ["train.device=cuda", "save.signal=SIGUSR2", tricky,
                                "train.out_dir=runs", f"{tmp_path}/runs/slurm-4242 8 USR2 24242"]
    # The body is the checked-in template's, word for word; and it is valid bash.
    assert script.endswith(template_parts()[1])
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    for line in ('srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 --kill-on-bad-exit=1',
                 '--rdzv-backend=c10d --rdzv-endpoint="${head_addr}:${RDZV_PORT}" '
                 '--rdzv-id="$SLURM_JOB_ID"', 'scontrol requeue "$SLURM_JOB_ID"'):
        assert line in script


def test_environment_defaults_yield_to_the_environment_and_to_env_flags(monkeypatch, capsys,
                                                                         tmp_path) -> None:
    script = _dry_run(monkeypatch, capsys, tmp_path, "--cpus-per-task", "16",
                      "--nproc-per-node", "4", "--env", "NCCL_DEBUG=INFO",
                      "--env", "NCCL_SOCKET_IFNAME=ib0")
    names = [*DEFAULTS, "NCCL_SOCKET_IFNAME", "OMP_NUM_THREADS"]
    show = 'for v in ' + " ".join(names) + '; do echo "$v=${!v}"; done'
    values = dict(line.split("=", 1) for line in _bash(script, show).splitlines())
    assert values["NCCL_DEBUG"] == "INFO" and values["NCCL_SOCKET_IFNAME"] == "ib0"
    assert values["OMP_NUM_THREADS"] == "4"  # 16 CPUs shared by 4 processes
    assert values["TORCH_FR_DUMP_TEMP_FILE"] == f"{tmp_path}/outputs/slurm-4242/nccl_trace_rank_"
    assert values["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    # A variable exported before sbatch beats a default, but not an explicit --env.
    env = {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync", "NCCL_DEBUG": "TRACE"}
    values = dict(line.split("=", 1) for line in _bash(script, show, env=env).splitlines())
    assert values["PYTORCH_CUDA_ALLOC_CONF"] == "backend:cudaMallocAsync"
    assert values["NCCL_DEBUG"] == "INFO"


def test_checked_in_template_exports_the_defaults() -> None:
    with open(TEMPLATE) as f:
        text = f.read()
    settings = text.split(SETTINGS_END)[0]  # the body's own exports (threads) come after
    assert [line for line in settings.splitlines() if line.startswith("export ")] == \
        export_lines(merged({}))
    subprocess.run(["bash", "-n", TEMPLATE], check=True)
    printed = subprocess.run(["python", "-m", "launch.cluster_env"], capture_output=True,
                             text=True, check=True, cwd=os.path.dirname(os.path.dirname(TEMPLATE)))
    assert printed.stdout.splitlines()[1:] == export_lines(merged({}))


def test_a_sweep_becomes_one_script_per_combination(monkeypatch, capsys, tmp_path) -> None:
    out = _dry_run(monkeypatch, capsys, tmp_path, "--nodes", "2", "--",
                   "checkpointing=none,full", "optim.lr=0.001,0.0003", "train.steps=5")
    scripts = out.split("# ===== job ")[1:]
    assert len(scripts) == 4
    args = [_bash(s[s.index("#!/bin/bash"):], 'echo "${TRAINER_ARGS[*]}"').strip()
            for s in scripts]
    assert args == [f"checkpointing={c} optim.lr={lr} train.steps=5"
                    for c in ("none", "full") for lr in ("0.001", "0.0003")]
    assert [f"--job-name=blocktrain-{i}" in s for i, s in enumerate(scripts)] == [True] * 4


@pytest.mark.parametrize("argv,message", [
    (["--gpus-per-node", "0", "--", "train.device=cuda"],
     "error: --gpus-per-node: 0, but train.device=cuda; request GPUs or set train.device=cpu"),
    (["--gpus-per-node", "4", "--nproc-per-node", "8"],
     "error: --nproc-per-node: 8 processes per node but --gpus-per-node 4; each process drives "
     "one GPU"),
    (["--", "save.resume=false"],
     "error: save.resume: false: a preempted and requeued job would start over; keep "
     "save.resume=true for Slurm jobs"),
    (["--", "-m", "checkpointing=none,full"],
     "error: -m: not needed: a sweep in the overrides becomes one job each"),
    (["--time", "4h"], "error: --time: '4h' is not a Slurm time (MM, HH:MM:SS, D-HH:MM, ...)"),
    (["--env", "NCCL DEBUG"], "error: --env: expected NAME=VALUE"),
    (["--", "checkpointing=none,fulll"],
     "error: checkpointing=fulll: unknown checkpointing; choose one of auto, budget, compiler, "
     "every_k, file, full, none, selective, sqrt"),
])
def test_bad_requests_name_the_flag(monkeypatch, capsys, tmp_path, argv, message) -> None:
    monkeypatch.setattr(slurm, "slurm_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    assert slurm.main(["--dry-run", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [message] and captured.out == ""


def test_validate_without_slurm_says_where_to_run_it(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol
    assert slurm.main(["--validate"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: slurm: scontrol is not on PATH; run this on a machine of the cluster (e.g. a "
        "login node)")


def test_validate_prints_each_job_and_submits_nothing(monkeypatch, capsys, tmp_path) -> None:
    monkeypatch.setattr(slurm, "query", lambda: from_scontrol(PARTITIONS, NODES))
    monkeypatch.setattr(slurm, "submit", lambda job: pytest.fail("submitted"))
    monkeypatch.chdir(tmp_path)
    assert slurm.main(["--validate", "--nodes", "2", "--gpus-per-node", "8", "--",
                       "train.device=cuda", "checkpointing=none,full"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines == [f"ok: blocktrain-{i}: 2 nodes x 8 processes (world 16); partition gpu: 3 "
                     "nodes, 64 CPUs and 4/8 GPUs per node, time limit 172800 s; overrides: "
                     f"train.device=cuda checkpointing={policy}"
                     for i, policy in enumerate(("none", "full"))]


def test_job_script_gives_each_trainer_its_share_of_threads() -> None:
    """torchrun sets OMP_NUM_THREADS=1 (and prints a banner) when it is unset; the job script
    sets each trainer's share of the task's CPUs instead, and a value given beforehand wins."""
    body = template_parts()[1]
    lines = [line for line in body.splitlines()
             if line.startswith(("cpus=", "export OMP_NUM_THREADS"))]
    assert len(lines) == 2
    for env, expected in (({"SLURM_CPUS_PER_TASK": "16"}, "4"),
                          ({"SLURM_CPUS_PER_TASK": "2"}, "1"),
                          ({"SLURM_CPUS_PER_TASK": "16", "OMP_NUM_THREADS": "7"}, "7")):
        out = subprocess.run(["bash", "-c", "NPROC_PER_NODE=4\n" + "\n".join(lines)
                              + '\necho "$OMP_NUM_THREADS"'], env={"PATH": "/usr/bin:/bin", **env},
                             capture_output=True, text=True, check=True).stdout.strip()
        assert out == expected, (env, out)


def test_flight_recorder_variables_are_the_names_this_torch_reads() -> None:
    """torch 2.8 renamed TORCH_NCCL_TRACE_BUFFER_SIZE (and the dump file's variable) and warns
    on the old names; the defaults use the names the installed torch's c10d library holds."""
    import mmap

    import torch

    from launch.cluster_env import FR_BUFFER_SIZE, FR_DUMP_FILE

    assert FR_BUFFER_SIZE in DEFAULTS and FR_DUMP_FILE in DEFAULTS
    library = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    if not os.path.exists(library):
        pytest.skip(f"no {library} to read the names from")
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        for name in (FR_BUFFER_SIZE, FR_DUMP_FILE):
            assert data.find(name.encode() + b"\0") >= 0, name
    assert FR_BUFFER_SIZE == "TORCH_FR_BUFFER_SIZE"  # torch >= 2.8 here (2.11 and 2.13 run)
