"""Losses of a fixed set of 2-rank runs, to hold a refactor to "bit for bit the same".

    python -m tests.loss_record record BEFORE.json [--only SUBSTRING]
    python -m tests.loss_record compare BEFORE.json AFTER.json

Every checkpointing policy (dropout on) with and without `offload=disk` and the chunked head, a
`data=chat` run with a ChatML tokenizer, an HF Llama and a ViT: each run's logged losses,
validation losses and gradient norms, as exact floats. Not part of the suite (about 10 minutes on
2 cores); run it before and after a change that must not move the numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from tests.helpers import QUICK, read_metrics, run_trainer

POLICIES = ("none", "full", "every_k", "sqrt", "selective", "budget")
COMMON = [*QUICK, "train.steps=6", "save.every=0", "train.eval_every=3"]
DROPOUT = "model.dropout=0.1"  # an HF model takes its dropout from its own config (HF_LLAMA)
HF_LLAMA = ("model.hf_config={model_type: llama, vocab_size: 256, hidden_size: 64, "
            "intermediate_size: 128, num_hidden_layers: 4, num_attention_heads: 4, "
            "num_key_value_heads: 2, max_position_embeddings: 128, attention_dropout: 0.1}")
VIT = ["model=vit_tiny", "model.image_size=32", "model.patch_size=8", "model.dim=32",
       "model.n_heads=2", "data=synthetic_images"]


def runs(workdir: Path) -> dict[str, list[str]]:
    out = {}
    for policy in POLICIES:
        for offload in ("none", "disk"):
            for head in ("plain", "chunked"):
                out[f"{policy}-{offload}-{head}"] = [
                    f"checkpointing={policy}", f"offload={offload}",
                    f"checkpointing.head={head}", "checkpointing.profile_repeats=1", DROPOUT]
    out["chat"] = ["data=chat", f"data.path={workdir / 'chats.jsonl'}",
                   f"data.tokenizer={workdir / 'tok'}", "model.vocab_size=300",
                   f"data.cache_dir={workdir / 'cache'}", "checkpointing=full", DROPOUT]
    out["hf-llama-selective"] = ["model=hf", HF_LLAMA, "checkpointing=selective"]
    out["vit-full"] = [*VIT, "checkpointing=full", DROPOUT]
    return out


def numbers(run_dir: Path) -> dict[str, list]:
    records = read_metrics(run_dir)
    return {key: [[m["step"], m[key]] for m in records if key in m]
            for key in ("loss", "val_loss", "grad_norm", "val_accuracy")}


def record(path: Path, only: str) -> None:
    from trainer.data.demo import chat_records, make_tokenizer, write_jsonl

    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        make_tokenizer(work / "tok")
        write_jsonl(work / "chats.jsonl", chat_records(200))
        for name, overrides in runs(work).items():
            if only not in name:
                continue
            result = run_trainer([*COMMON, *overrides, f"train.out_dir={work / 'out'}",
                                  f"train.run_name={name}"], cwd=work, nproc=2, timeout=600)
            if result.returncode != 0:  # the runs so far are kept; the rest is not run
                sys.exit(f"{name}: exit {result.returncode}\n{result.stderr[-3000:]}")
            found[name] = numbers(work / "out" / name)
            path.write_text(json.dumps(found, indent=1))
            print(name, found[name]["loss"][-1], flush=True)


def compare(before: Path, after: Path) -> int:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    differ = [name for name in a if a[name] != b.get(name)]
    missing = sorted(set(a) ^ set(b))
    for name in differ:
        print(f"differs: {name}")
    for name in missing:
        print(f"only in one: {name}")
    print(f"{len(a) - len(differ)} of {len(a)} runs identical bit for bit")
    return 1 if differ or missing else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("out", type=Path)
    rec.add_argument("--only", default="")
    cmp = sub.add_parser("compare")
    cmp.add_argument("before", type=Path)
    cmp.add_argument("after", type=Path)
    args = parser.parse_args()
    if args.command == "record":
        record(args.out, args.only)
    else:
        sys.exit(compare(args.before, args.after))


if __name__ == "__main__":
    main()
