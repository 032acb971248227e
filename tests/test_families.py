"""The model families (trainer/models/families/): the registry has one for every conf/model/*.yaml
and refuses any other arch in one line; importing them does not import torch; one config makes
one task, its chunked head from the one default formula; and each family's attention hook
reaches every block's attention, so a wrapper that calls the attention it replaced gives the
model's outputs bit for bit (the hook sequence parallelism will use)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from checkpointing.plan import default_chunk_tokens
from tests.helpers import REPO, config, subprocess_env
from trainer.build import build_on_meta, materialize
from trainer.config import ConfigError
from trainer.models.attention import redirect_sdpa, wrap_attend
from trainer.models.families import FAMILIES, family_named, family_of
from trainer.task import task_for
from trainer.validate import validate

HF_LLAMA = ("model.hf_config={model_type: llama, vocab_size: 300, hidden_size: 32, "
            "intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4, "
            "num_key_value_heads: 2, max_position_embeddings: 64}")
HF_VIT = ("model.hf_config={model_type: vit, hidden_size: 32, num_hidden_layers: 2, "
          "num_attention_heads: 2, intermediate_size: 64, patch_size: 8}")
IMAGES = ["model.image_size=16", "model.patch_size=8", "data=synthetic_images"]
SMALL = {"llama": ["model=tiny", "model.n_layers=2"],
         "qwen3": ["model=qwen3_tiny", "model.n_layers=2"],
         "vit": ["model=vit_tiny", "model.dim=48", "model.ffn_hidden=96", "model.n_layers=2",
                 *IMAGES],
         "hf": ["model=hf", HF_LLAMA],
         "hf_vision": ["model=hf_vision", HF_VIT, *IMAGES]}


def test_every_model_preset_has_a_family() -> None:
    presets = sorted(p.stem for p in (REPO / "conf" / "model").glob("*.yaml"))
    assert len(presets) >= 5
    archs = {config(f"model={name}").model.arch for name in presets}
    assert archs == set(FAMILIES)
    assert all(family_named(arch).arch == arch for arch in archs)


def test_an_unknown_arch_is_refused_in_one_line() -> None:
    expected = "model.arch: got 'gpt'; choose one of llama, hf, vit, hf_vision, timm, qwen3"
    with pytest.raises(ConfigError, match="^model.arch") as raised:
        validate(config("model.arch=gpt"), world_size=1)
    assert str(raised.value) == expected and raised.value.key == "model.arch"
    with pytest.raises(ConfigError) as raised:
        family_named("gpt")
    assert str(raised.value) == expected


def test_families_import_without_torch() -> None:
    code = ("import sys, trainer.models.families, trainer.task, trainer.validate; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, env=subprocess_env(), check=True)


def test_the_families_say_what_a_sample_is() -> None:
    assert {a for a, f in FAMILIES.items() if f.sample == "tokens"} == {"llama", "hf", "qwen3"}
    assert {a for a, f in FAMILIES.items() if f.sample == "images"} == {"vit", "hf_vision", "timm"}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "hf"])
def test_one_config_makes_one_task_with_the_default_chunk(arch: str) -> None:
    cfg = config(*SMALL[arch], "checkpointing.head=chunked", "checkpointing.head_budget_mib=1")
    task = task_for(cfg.model, cfg.data, cfg.checkpointing)
    vocab = family_of(cfg.model).vocab_size(cfg.model)
    assert vocab == (300 if arch == "hf" else cfg.model.vocab_size)
    assert task.head_chunk == default_chunk_tokens(vocab, 2**20) == 2**20 // (vocab * 4)
    fixed = config(*SMALL[arch], "checkpointing.head=chunked", "checkpointing.head_chunk_tokens=7")
    assert task_for(fixed.model, fixed.data, fixed.checkpointing).head_chunk == 7
    plain = config(*SMALL[arch])
    assert task_for(plain.model, plain.data, plain.checkpointing).head_chunk is None


def test_image_models_keep_their_plain_head() -> None:
    cfg = config(*SMALL["vit"], "checkpointing.head=chunked")
    task = task_for(cfg.model, cfg.data, cfg.checkpointing)
    assert (task.kind, task.head_chunk, task.tokens_per_sample) == ("classification", None, 4)


def _model(arch: str):
    if arch.startswith("hf"):
        pytest.importorskip("transformers")
    cfg = config(*SMALL[arch], "model.dropout=0.0")
    model = build_on_meta(cfg.model)
    materialize(model, torch.device("cpu"), seed=0)
    return cfg, model.eval()


def _inputs(cfg):
    generator = torch.Generator().manual_seed(1)
    if family_of(cfg.model).sample == "tokens":
        tokens = torch.randint(0, 200, (2, 12), generator=generator)
        positions = torch.cat([torch.arange(5), torch.arange(7)]).repeat(2, 1)
        return [(tokens,), (tokens, positions)]  # one sequence per row; two documents per row
    return [(torch.randn(2, 3, 16, 16, generator=generator),)]


def _forward(model, inputs: tuple) -> torch.Tensor:
    with torch.no_grad():
        return model(inputs[0]) if len(inputs) == 1 else model(inputs[0], positions=inputs[1])


@pytest.mark.parametrize("arch", ["llama", "qwen3", "vit", "hf", "hf_vision"])
def test_wrapping_the_attention_with_itself_changes_nothing(arch: str) -> None:
    cfg, model = _model(arch)
    family = family_of(cfg.model)
    before = [_forward(model, x) for x in _inputs(cfg)]
    calls = []

    def passing(inner):
        def attend(q, k, v, **options):
            calls.append(q.shape)  # [B, heads, T, head_dim]
            return inner(q, k, v, **options)
        return attend

    assert family.wrap_attention(model, passing) == len(family.attention_modules(model)) == 2
    after = [_forward(model, x) for x in _inputs(cfg)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    tokens = 12 if family.sample == "tokens" else 5  # 4 patches and the class token
    assert len(calls) == 2 * len(before) and all(s[0] == 2 and s[2] == tokens for s in calls)
    family.wrap_attention(model, lambda inner: lambda q, k, v, **o: torch.zeros_like(q))
    assert not torch.equal(_forward(model, _inputs(cfg)[0]), before[0])  # the hook is live


def test_a_redirected_module_calls_its_attend_for_sdpa() -> None:
    """How timm's attention modules (F.scaled_dot_product_attention inside their forward) are
    reached, shown on a module of that shape."""
    class Inside(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2

    module, q = Inside(), torch.randn(1, 2, 6, 4, generator=torch.Generator().manual_seed(0))
    before = module(q, q, q)
    redirect_sdpa(module)
    seen = []
    assert wrap_attend([module], lambda inner: lambda *a, **o: seen.append(o) or inner(*a, **o))
    assert torch.equal(module(q, q, q), before) and seen == [{"is_causal": True}]
    wrap_attend([module], lambda inner: lambda q, k, v, **o: torch.ones_like(q))
    assert torch.equal(module(q, q, q), torch.full_like(q, 2.0))


@pytest.mark.parametrize("overrides, says", [
    (["model.n_heads=3"], "model.n_heads: must divide model.dim=128, got 3"),
    (["model.dim=96", "model.n_heads=32", "model.n_kv_heads=4"],
     "model.n_heads: head size model.dim/model.n_heads=3 must be even"),
    (["model.n_kv_heads=3"], "model.n_kv_heads: must divide model.n_heads=4, got 3"),
    (["data.seq_len=1024"], "data.seq_len: 1024 exceeds model.max_seq_len=512"),
    (["model.head_dim=33"], "model.head_dim: must be null"),
    (["model=qwen3_tiny", "model.n_kv_heads=3"], "model.n_kv_heads: must divide"),
    (["model=vit_tiny", "data=synthetic_images", "model.patch_size=15"],
     "model.patch_size: must divide model.image_size=224, got 15"),
    (["model=vit_tiny", "data=synthetic_images", "model.channels=2"], "model.channels: 1 (grey)"),
])
def test_each_family_refuses_its_own_shapes_in_one_line(overrides, says) -> None:
    with pytest.raises(ConfigError, match="^" + says.replace("(", r"\(").replace(")", r"\)")):
        validate(config(*overrides), world_size=1)


def test_the_llama_rules_are_not_applied_to_other_families() -> None:
    """model=hf's shapes are its HF config's: the built-in Llama's unused fields (a head size of
    128/3, max_seq_len 512) no longer refuse it, as they did when validate asked every
    language model the Llama's questions."""
    validate(config(*SMALL["hf"], "model.n_heads=3", "data.seq_len=1024"), world_size=1)
    # A 5120-wide Qwen3 with 64 heads of 128: its own head_dim, not dim / n_heads.
    validate(config("model=qwen3_32b", "data=synthetic"), world_size=1)
