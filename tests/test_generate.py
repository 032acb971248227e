"""Talking to a trained model (issue 48, item 3): `python -m trainer.generate` reads a run's sharded
checkpoint in one process, with the run's tokenizer and chat template, greedy or sampled; the
export folder is whole for transformers (weights, config, tokenizer, chat template,
generation_config.json), which then gives our logits and our greedy tokens."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from tests.helpers import QUICK, REPO, check_ok, run_trainer  # noqa: E402
from trainer.data.demo import chat_records, make_tokenizer, write_jsonl  # noqa: E402
from trainer.generate.cli import main as generate_main  # noqa: E402
from trainer.generate.decode import Sampling, generate  # noqa: E402
from trainer.generate.load import load  # noqa: E402
from trainer.state.export import main as export_main  # noqa: E402

pytestmark = pytest.mark.slow

HF_LLAMA = ("model.hf_config={model_type: llama, vocab_size: 320, hidden_size: 64, "
            "intermediate_size: 128, num_hidden_layers: 2, num_attention_heads: 4, "
            "num_key_value_heads: 2, max_position_embeddings: 96}")
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick fox"}]


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory) -> dict:
    """A model=hf chat run saved by 2 ranks (a sharded DCP checkpoint), and its tokenizer."""
    work = tmp_path_factory.mktemp("hf_chat")
    tok = make_tokenizer(work / "tok")
    write_jsonl(work / "chats.jsonl", chat_records(40, seed=2))
    run_dir = work / "run"
    check_ok(run_trainer([*QUICK, "model=hf", HF_LLAMA, "data=chat",
                          f"data.path={work / 'chats.jsonl'}", f"data.tokenizer={tok}",
                          f"data.cache_dir={work / 'cache'}", "train.steps=2",
                          "train.micro_batch_size=2", f"hydra.run.dir={run_dir}"], REPO, nproc=2))
    return {"run": run_dir, "tok": tok, "work": work}


def _greedy_of_ours(folder, prompt: list[int], n: int) -> list[int]:
    loaded = load(str(folder), torch.device("cpu"))
    stop = {loaded.tokenizer.eos_token_id}
    return generate(loaded.logits, prompt, n, Sampling(), stop, loaded.device, loaded.limit)


def test_hf_export_is_whole_and_transformers_gives_our_logits_and_tokens(hf_run) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = hf_run["work"] / "export"
    assert export_main([str(hf_run["run"]), "--out", str(out)]) == 0
    ours_tok = AutoTokenizer.from_pretrained(str(hf_run["tok"]))
    theirs_tok = AutoTokenizer.from_pretrained(str(out))
    assert len(theirs_tok) == len(ours_tok) == 300  # the real tokenizer, not an empty one
    text = ours_tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert theirs_tok.apply_chat_template(CHAT, add_generation_prompt=True,
                                          tokenize=False) == text
    prompt = ours_tok(text, add_special_tokens=False)["input_ids"]
    assert theirs_tok(text, add_special_tokens=False)["input_ids"] == prompt
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == ours_tok.eos_token_id == ours_tok.convert_tokens_to_ids(
        "<|im_end|>")
    assert generation["pad_token_id"] == ours_tok.pad_token_id

    hf = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    ours = load(str(hf_run["run"]), torch.device("cpu"))  # the DCP checkpoint, no export
    tokens = torch.tensor([prompt])
    with torch.no_grad():
        torch.testing.assert_close(ours.logits(tokens), hf(input_ids=tokens).logits,
                                   rtol=1e-5, atol=1e-5)
        theirs = hf.generate(tokens, max_new_tokens=12, do_sample=False)[0, len(prompt):]
    theirs = [t for t in theirs.tolist() if t != ours_tok.eos_token_id]
    mine = _greedy_of_ours(hf_run["run"], prompt, 12)
    assert mine == theirs and len(mine) > 0
    assert _greedy_of_ours(out, prompt, 12) == mine  # the export folder reads back the same


def test_prompt_and_scripted_chat_stream_the_greedy_tokens(hf_run, capsys) -> None:
    run = str(hf_run["run"])
    assert generate_main([run, "--prompt", "the quick", "--max-new-tokens", "8"]) == 0
    tok = load(run, torch.device("cpu")).tokenizer
    prompt = tok("the quick", add_special_tokens=False)["input_ids"]
    expected = tok.decode(_greedy_of_ours(run, prompt, 8), skip_special_tokens=True)
    assert capsys.readouterr().out == f"the quick{expected}\n"

    assert generate_main([run, "--chat", "--system", "be brief", "--message", "the quick fox",
                          "--message", "again", "--max-new-tokens", "6"]) == 0
    lines = capsys.readouterr().out.splitlines()
    text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    first = tok.decode(_greedy_of_ours(run, tok(text, add_special_tokens=False)["input_ids"], 6),
                       skip_special_tokens=True)
    assert lines[:2] == ["user: the quick fox", f"assistant: {first}"]
    assert lines[2] == "user: again" and lines[3].startswith("assistant: ") and len(lines) == 4


def test_sampling_follows_its_seed(hf_run, capsys) -> None:
    def sampled(seed: int) -> str:
        args = [str(hf_run["run"]), "--prompt", "a", "--max-new-tokens", "16",
                "--temperature", "3", "--top-k", "100", "--top-p", "0.95", "--seed", str(seed)]
        assert generate_main(args) == 0
        return capsys.readouterr().out

    first = sampled(1)
    assert sampled(1) == first
    assert sampled(2) != first


def test_top_k_and_top_p_keep_only_the_likeliest() -> None:
    from trainer.generate.decode import choose

    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    draws = {choose(logits, Sampling(temperature=1.0, top_k=2), torch.Generator().manual_seed(s))
             for s in range(50)}
    assert draws == {1, 2}
    peaked = torch.tensor([10.0, 0.0, 0.0, 0.0])
    assert {choose(peaked, Sampling(temperature=1.0, top_p=0.5),
                   torch.Generator().manual_seed(s)) for s in range(20)} == {0}


def _one_error_line(capsys, argv: list[str]) -> str:
    assert generate_main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err and captured.out == ""
    return lines[0]


def test_bad_input_is_one_line_and_exit_2(hf_run, tmp_path, capsys) -> None:
    run = str(hf_run["run"])
    line = _one_error_line(capsys, [str(tmp_path), "--prompt", "x"])
    assert line == (f"error: {tmp_path}: not a run directory, a checkpoints/step_<N> folder or "
                    "an export folder")
    line = _one_error_line(capsys, [run, "--prompt", "the quick brown fox " * 40])
    assert line.startswith("error: --prompt: ") and "the model reads at most 96" in line
    bare = make_tokenizer(tmp_path / "bare", vocab_size=300, template=None)
    line = _one_error_line(capsys, [run, "--chat", "--message", "hi", "--tokenizer", str(bare)])
    assert line.startswith("error: --chat: the run's tokenizer") and "no chat template" in line


def test_builtin_llama_export_loads_in_transformers_with_our_logits(tmp_path) -> None:
    """The built-in Llama exported in transformers' Llama format (issue 43 item 4) gives our
    logits and greedy tokens; data=bytes: the byte tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, out = tmp_path / "run", tmp_path / "export"
    check_ok(run_trainer([*QUICK, "train.steps=2", f"hydra.run.dir={run_dir}"], REPO))
    assert export_main([str(run_dir), "--out", str(out)]) == 0
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok("def f", add_special_tokens=False)["input_ids"] == list(b"def f")
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    hf = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    prompt = list(b"def main(")
    tokens = torch.tensor([prompt])
    with torch.no_grad():
        torch.testing.assert_close(load(str(run_dir), torch.device("cpu")).logits(tokens),
                                   hf(input_ids=tokens).logits, rtol=1e-5, atol=1e-5)
        theirs = hf.generate(tokens, max_new_tokens=12, do_sample=False)[0, len(prompt):]
    assert _greedy_of_ours(run_dir, prompt, 12) == theirs.tolist()


@pytest.mark.cuda
def test_generate_on_the_gpu_gives_the_cpu_greedy_tokens(hf_run, capsys) -> None:
    run = str(hf_run["run"])
    outputs = []
    for device in ("cpu", "cuda"):
        assert generate_main([run, "--prompt", "the quick", "--max-new-tokens", "8",
                              "--device", device]) == 0
        outputs.append(capsys.readouterr())
    assert "on cuda" in outputs[1].err
    assert outputs[0].out == outputs[1].out
