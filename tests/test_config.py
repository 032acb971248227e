"""Config: every YAML composes and validates; every bad input is one line, once, exit 2."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import asdict
from importlib.resources import files

import pytest

from tests.helpers import config, run_trainer, subprocess_env
from trainer.cli import check
from trainer.config import ConfigError

GROUPS = ("model", "data", "optim", "train", "sharding", "checkpointing", "offload", "logging")


def _options(group: str) -> list[str]:
    return sorted(p.name[:-5] for p in files("conf").joinpath(group).iterdir()
                  if p.name.endswith(".yaml"))


@pytest.mark.parametrize("group", GROUPS)
def test_every_yaml_composes_and_validates(group: str, tmp_path) -> None:
    options = _options(group)
    assert options, f"conf/{group} has no YAML"
    for option in options:
        overrides = [f"{group}={option}"]
        if (group, option) == ("data", "tokens"):
            (tmp_path / "train.bin").write_bytes(bytes(4096))
            (tmp_path / "val.bin").write_bytes(bytes(4096))
            overrides += [f"data.train_path={tmp_path / 'train.bin'}",
                          f"data.val_path={tmp_path / 'val.bin'}"]
        if group == "model" and option not in ("tiny", "hf_vision", "timm") and \
                not option.startswith("vit"):  # image models keep their image data
            overrides.append("data.source=synthetic")
        if (group, option) == ("data", "images"):  # a folder per split, one image per class
            from PIL import Image

            for split in ("train", "val"):
                for label in ("cat", "dog"):
                    (tmp_path / split / label).mkdir(parents=True)
                    Image.new("RGB", (40, 30)).save(tmp_path / split / label / "0.png")
            overrides += ["model=vit_tiny", "model.num_classes=2",
                          f"data.train_path={tmp_path / 'train'}",
                          f"data.val_path={tmp_path / 'val'}"]
        if (group, option) == ("data", "synthetic_images"):
            overrides.append("model=vit_tiny")
        if (group, option) in (("data", "text"), ("data", "chat")):  # documents, a tokenizer
            overrides += [f"data.path={tmp_path / 'docs.jsonl'}", f"data.tokenizer={tmp_path}",
                          "data.seq_len=256"]
        if (group, option) == ("model", "hf"):  # needs a model: one built from a config
            overrides.append("model.hf_config={model_type: llama, num_hidden_layers: 2}")
        if (group, option) == ("model", "hf_vision"):
            overrides.append("model.hf_config={model_type: vit, num_hidden_layers: 2}")
        if (group, option) == ("checkpointing", "file"):  # needs a plan.json
            (tmp_path / "plan.json").write_text("[]")
            overrides.append(f"checkpointing.plan_file={tmp_path / 'plan.json'}")
        if (group, option) == ("checkpointing", "auto"):  # no default memory off a GPU
            overrides.append("train.memory_gib=2")
        if (group, option) == ("model", "timm") and not timm_imports():
            with pytest.raises(ConfigError, match="model.arch: timm needs the timm package"):
                check(overrides, env={})
            continue
        cfg, layout = check(overrides, env={"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
        assert getattr(cfg, group) is not None and layout.world_size == 2
        if group == "model" and option != "timm":  # timm's name is the timm model's
            assert cfg.model.name == option  # the preset's name matches its file


def timm_imports() -> bool:
    try:
        import timm  # noqa: F401
    except Exception:  # not installed, or a torchvision built for another torch
        return False
    return True


def test_config_keys_are_frozen() -> None:
    """Adding or renaming a key is deliberate: update this list and README's reference."""
    keys = {f"{group}.{key}" for group, node in asdict(config()).items() for key in node}
    assert keys == {
        "model.name", "model.arch", "model.dim", "model.n_layers", "model.n_heads",
        "model.n_kv_heads", "model.head_dim", "model.vocab_size", "model.ffn_hidden", "model.max_seq_len",
        "model.norm_eps", "model.rope_theta", "model.dropout", "model.tie_embeddings",
        "model.block_pattern", "model.path", "model.hf_config", "model.attn_implementation",
        "model.attention",
        "model.freeze", "model.image_size", "model.patch_size", "model.channels",
        "model.num_classes", "model.checkpoint_path", "model.timm_args", "model.lora",
        "data.source", "data.seq_len", "data.train_path", "data.val_path", "data.token_dtype",
        "data.max_corpus_bytes", "data.workers", "data.augment", "data.skip_bad_images",
        "data.path", "data.split", "data.tokenizer", "data.text_field", "data.messages_field",
        "data.prompt_field", "data.completion_field", "data.format", "data.train_on",
        "data.packing", "data.overlong", "data.val_fraction", "data.cache_dir", "data.streaming",
        "data.on_change", "data.skip_bad_records", "data.num_proc",
        "optim.lr", "optim.min_lr_ratio", "optim.warmup_steps", "optim.weight_decay",
        "optim.beta1", "optim.beta2", "optim.eps", "optim.grad_clip",
        "train.steps", "train.seed", "train.micro_batch_size", "train.grad_accum",
        "train.global_batch_size", "train.eval_every", "train.eval_batches",
        "train.eval_at_start", "train.run_name",
        "train.out_dir", "train.device", "train.compile", "train.compile_backend",
        "train.cpu_heap",
        "train.dist_timeout_s",
        "train.stop_at_step", "train.memory_gib", "train.memory_reserve_gib",
        "train.host_reserve_gib",
        "sharding.mode", "sharding.replicate", "sharding.reshard_after_forward",
        "sharding.param_dtype", "sharding.reduce_dtype", "sharding.cpu_offload", "sharding.sequence",
        "sharding.context",
        "checkpointing.policy", "checkpointing.every", "checkpointing.save_ops",
        "checkpointing.budget", "checkpointing.profile_repeats", "checkpointing.profile",
        "checkpointing.plan_file",
        "checkpointing.head", "checkpointing.head_chunk_tokens", "checkpointing.head_budget_mib",
        "checkpointing.head_rows", "checkpointing.head_supervised_fraction",
        "checkpointing.tiles",
        "offload.target", "offload.min_bytes", "offload.keep_last", "offload.max_host_bytes",
        "offload.dir", "offload.max_inflight_bytes", "offload.trim_heap",
        "save.every", "save.keep", "save.async_save", "save.at_end", "save.resume", "save.dir",
        "save.signal", "save.preempt_exit_code",
        "faults.skip_nonfinite", "faults.max_bad_steps", "faults.spike_factor",
        "faults.spike_window", "faults.max_rollbacks", "faults.inject_nan_at",
        "faults.inject_spike_at", "faults.inject_hang_at", "faults.inject_slow_at",
        "faults.inject_slow_s",
        "logging.every", "logging.progress", "logging.wandb", "logging.wandb_project",
        "logging.wandb_entity", "logging.wandb_init_timeout_s", "logging.live_bytes_step",
        "logging.alert_interval_s", "logging.alert_throughput_fraction",
        "logging.alert_throughput_window", "logging.alert_memory_margin",
        "logging.wandb_checkpoint_refs",
    }


def test_derived_layout() -> None:
    env = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    _, layout = check(["sharding=hsdp"], env)  # replicate defaults to the number of nodes
    assert (layout.replicate, layout.shard) == (2, 2)
    _, layout = check(["train.micro_batch_size=2", "train.global_batch_size=32"], env)
    assert (layout.grad_accum, layout.global_batch_size) == (4, 32)


# (overrides, param_dtype, reduce_dtype): the big presets default to bf16 parameters with fp32
# reduce under FSDP/HSDP (conf/precision/), whatever the order on the command line; the command
# line still wins; sharding=none (DDP, no mixed precision) stays fp32 and valid.
PRESET_DTYPES = [
    (["model=llama_8b"], "bfloat16", "float32"),
    (["model=llama_70b"], "bfloat16", "float32"),
    (["model=llama_8b", "sharding=hsdp"], "bfloat16", "float32"),
    (["sharding=hsdp", "model=llama_70b"], "bfloat16", "float32"),
    (["model=llama_8b", "sharding.param_dtype=null"], None, "float32"),
    (["sharding.param_dtype=null", "sharding.reduce_dtype=null", "model=llama_70b"], None, None),
    (["model=llama_8b", "sharding=hsdp", "sharding.reduce_dtype=bfloat16"], "bfloat16",
     "bfloat16"),
    (["model=llama_8b", "sharding=none"], None, None),
    (["model=llama_70b", "sharding=none"], None, None),
    (["model=tiny"], None, None),
    (["model=llama_1b"], None, None),
]


@pytest.mark.parametrize("overrides,param_dtype,reduce_dtype", PRESET_DTYPES)
def test_big_presets_default_to_bf16_with_fp32_reduce(overrides, param_dtype, reduce_dtype):
    cfg, _ = check([*overrides, "data=synthetic"], {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"},
                   local_gpus=False)
    assert (cfg.sharding.param_dtype, cfg.sharding.reduce_dtype) == (param_dtype, reduce_dtype)


def test_every_precision_file_names_a_model_and_a_sharding() -> None:
    """conf/precision/<model>_<sharding>.yaml is an optional defaults entry: a misnamed file (or
    a renamed preset) would be skipped without a word."""
    pairs = {f"{m}_{s}" for m in _options("model") for s in _options("sharding")}
    names = _options("precision")
    assert names and set(names) <= pairs, sorted(set(names) - pairs)
    assert not any(name.endswith("_none") for name in names)  # validate refuses it: DDP


# (overrides, key the one-line message must name, world size)
BAD_INPUTS = [
    (["train.steps=abc"], "train.steps", 1),
    (["train.steps=1.5"], "train.steps", 1),
    (["train.steps=-3"], "train.steps", 1),
    (["train.micro_batch_size=0"], "train.micro_batch_size", 1),
    (["data.seq_len=0"], "data.seq_len", 1),
    (["optim.lr=-1"], "optim.lr", 1),
    (["logging.wandb=maybe"], "logging.wandb", 1),
    (["model=gpt5"], "model=gpt5", 1),
    (["sharding=zero3"], "sharding=zero3", 1),
    (["train.stepz=3"], "train.stepz", 1),
    (["+train.extra=1"], "train.extra", 1),
    (["colour=blue"], "colour", 1),
    (["sharding=hsdp", "sharding.replicate=3"], "sharding.replicate", 2),
    (["sharding.replicate=2"], "sharding.replicate", 2),
    (["train.micro_batch_size=3", "train.global_batch_size=16"], "train.global_batch_size", 2),
    (["data.seq_len=4096"], "data.seq_len", 1),
    (["model.n_heads=3"], "model.n_heads", 1),
    (["data.source=web"], "data.source", 1),
    (["sharding.param_dtype=fp8"], "sharding.param_dtype", 1),
    (["sharding=none", "sharding.param_dtype=bfloat16"], "sharding.param_dtype", 1),
    (["data.source=tokens", "data.train_path=/nonexistent.bin", "data.val_path=/x.bin"],
     "data.train_path", 1),
    (["model.dropout=1.5"], "model.dropout", 1),
    (["train.device=tpu"], "train.device", 1),
    (["checkpointing=budget", "checkpointing.budget=-1"], "checkpointing.budget", 1),
    (["checkpointing=full", "checkpointing.budget=0.5"], "checkpointing.budget", 1),
    (["checkpointing=every_k", "checkpointing.every=0"], "checkpointing.every", 1),
    (["checkpointing=lazy"], "checkpointing=lazy", 1),
    (["offload=disk", "offload.dir=/proc/blocktrain"], "offload.dir", 1),
    (["offload=cpu", "offload.max_host_bytes=0"], "offload.max_host_bytes", 1),
    (["offload=tape"], "offload=tape", 1),
    (["sharding=none", "sharding.cpu_offload=true"], "sharding.cpu_offload", 1),
    (["checkpointing=compiler", "train.compile=false"], "train.compile", 1),
    (["checkpointing=compiler", "train.compile=true", "checkpointing.budget=0"],
     "checkpointing.budget", 1),
    (["data.workers=-1"], "data.workers", 1),
    (["data.augment=true"], "data.augment", 1),
    (["model=vit_tiny", "data=bytes"], "data.source", 1),
    (["data=synthetic_images"], "data.source", 1),
    (["model=vit_tiny", "model.image_size=100"], "model.patch_size", 1),
    (["model=vit_tiny", "model.channels=2"], "model.channels", 1),
    (["model=vit_tiny", "model.num_classes=0"], "model.num_classes", 1),
    (["model=vit_tiny", "data=images"], "data.train_path", 1),
    (["model=vit_tiny", "data=images", "data.train_path=/nonexistent", "data.val_path=/x"],
     "data.train_path", 1),
]


@pytest.mark.parametrize(("overrides", "key", "world"), BAD_INPUTS,
                         ids=[" ".join(o) for o, _, _ in BAD_INPUTS])
def test_bad_input_is_one_line_naming_the_key(overrides, key, world) -> None:
    env = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
    with pytest.raises(ConfigError) as info:
        check(overrides, env)
    message = str(info.value)
    assert key in message and "\n" not in message


def test_token_files_are_checked_before_start(tmp_path) -> None:
    (tmp_path / "train.bin").write_bytes(bytes(2 * 1000))
    (tmp_path / "val.bin").write_bytes(bytes(2 * 10))
    (tmp_path / "meta.json").write_text('{"vocab_size": 50257, "dtype": "uint16"}')
    paths = [f"data.train_path={tmp_path / 'train.bin'}", f"data.val_path={tmp_path / 'val.bin'}"]
    with pytest.raises(ConfigError, match="model.vocab_size: 256 is smaller than .* 50257"):
        check(["data=tokens", "data.seq_len=8", *paths], {})
    with pytest.raises(ConfigError, match="data.val_path: .* holds 10 tokens"):
        check(["data=tokens", "model.vocab_size=50304", *paths], {})
    with pytest.raises(ConfigError, match="data.token_dtype: uint32 but .* uint16"):
        check(["data=tokens", "model.vocab_size=50304", "data.seq_len=8",
               "data.token_dtype=uint32", *paths], {})


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_a_gpu_is_refused_before_start() -> None:
    with pytest.raises(ConfigError, match="train.device: cuda, but no CUDA device"):
        check(["train.device=cuda"], {})


@pytest.mark.parametrize("overrides", [["train.steps=abc"], ["model=gpt5"], ["train.stepz=3"],
                                        ["train.micro_batch_size=0"]])
def test_cli_bad_input_exits_2_with_one_line_and_writes_nothing(overrides, tmp_path) -> None:
    result = subprocess.run([sys.executable, "-m", "trainer", *overrides], cwd=tmp_path,
                            env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert list(tmp_path.iterdir()) == []  # no run directory, no outputs/


def test_torchrun_bad_input_reported_once_before_any_process_group(tmp_path) -> None:
    result = run_trainer(["sharding=hsdp", "sharding.replicate=3"], cwd=tmp_path, nproc=2,
                         timeout=120)
    assert result.returncode != 0
    ours = [line for line in (result.stdout + result.stderr).splitlines()
            if line.startswith("error: ")]
    assert ours == ["error: sharding.replicate: 3 does not divide the world size 2"]
    assert not (tmp_path / "outputs").exists()


def test_help_still_reaches_hydra(tmp_path) -> None:
    result = subprocess.run([sys.executable, "-m", "trainer", "--cfg", "job"], cwd=tmp_path,
                            env=subprocess_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "micro_batch_size: 16" in result.stdout


def test_a_single_run_composes_the_config_once(tmp_path) -> None:
    """trainer/__main__.py: a single run starts from the pre-flight check's composition (no
    private Hydra API, no second composition), with Hydra's run directory, config dump and
    train.log as before. Counted in a real `python -m trainer` process by wrapping Hydra's config
    loader, through which every composition goes (a test may patch a private API; the code does
    not)."""
    counter = tmp_path / "count.py"
    counter.write_text(
        "import atexit, runpy, sys\n"
        "from hydra._internal.config_loader_impl import ConfigLoaderImpl as L\n"
        "path = sys.argv.pop(1)\n"
        "calls = []\n"
        "load = L.load_configuration\n"
        "def counted(self, *a, **k):\n"
        "    calls.append(1)\n"
        "    return load(self, *a, **k)\n"
        "L.load_configuration = counted\n"
        "atexit.register(lambda: open(path, 'w').write(str(len(calls))))\n"
        "runpy.run_module('trainer', run_name='__main__', alter_sys=True)\n")
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, str(counter), str(tmp_path / "n"), "train.steps=1", "data=synthetic",
         "logging.wandb=false", "logging.progress=false", f"train.out_dir={out}",
         "train.run_name=once", "data.seq_len=32", "train.micro_batch_size=2",
         "save.every=0", "save.at_end=false"],
        cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "n").read_text() == "1"
    run_dir = out / "once"
    assert "- train.run_name=once" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert "run_name: once" in (run_dir / ".hydra" / "config.yaml").read_text()
    assert "output_dir: " + str(run_dir) in (run_dir / ".hydra" / "hydra.yaml").read_text()
    assert "[trainer][INFO] - per-block plan:" in (run_dir / "train.log").read_text()
