"""Benchmark text and chat data: tokenizing, the cache, packing, and what they cost a step.

    python -m launch.bench.data [--text-mb 100] [--chats 20000] [--steps 30] [--out DIR]

1. Tokenizing a generated jsonl of about --text-mb MB (documents/s, tokens/s), then the same
   again, which the cache answers (seconds, both starts).
2. Packing --chats generated conversations best-fit into 2048-token windows: the share of window
   tokens that are real (not padding), and of those supervised (assistant tokens).
3. The tiny model for --steps steps on data=chat against data=synthetic: median step time (the
   first 3 left out) and the ratio, and peak RSS with a 10x larger chat file (it should not grow:
   windows are memory-mapped).

The tokenizer is the small local ChatML BPE of trainer/data/demo.py: real tokenizers differ in
speed, so these figures say what blocktrain adds, not what a given tokenizer costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainer.data.demo import chat_records, make_tokenizer, text_records, write_jsonl
from trainer.data.documents import text_datasets
from trainer.data.sources import DocSettings


def bench_tokenize(root: Path, tokenizer: str, megabytes: float) -> dict:
    path = root / "text.jsonl"
    records, size = [], 0
    while size < megabytes * 1e6:
        chunk = text_records(2000, seed=len(records))
        records += chunk
        size += sum(len(json.dumps(r)) + 1 for r in chunk)
    write_jsonl(path, records)
    settings = DocSettings("text", 2048, True)
    starts = []
    for _ in range(2):
        started = time.perf_counter()
        train, _ = text_datasets(str(path), None, tokenizer, settings, str(root / "cache"),
                                 10_000, preparer=True)
        starts.append(time.perf_counter() - started)
    meta = json.loads((Path(train.folder).parent / "meta.json").read_text())
    return {"mb": os.path.getsize(path) / 1e6, "documents": meta["documents"],
            "tokens": meta["tokens"], "tokenize_s": meta["tokenize_s"],
            "docs_per_s": meta["documents"] / meta["tokenize_s"],
            "tokens_per_s": meta["tokens"] / meta["tokenize_s"], "first_start_s": starts[0],
            "second_start_s": starts[1]}


def bench_packing(root: Path, tokenizer: str, chats: int) -> dict:
    path = write_jsonl(root / "chat.jsonl", chat_records(chats, seed=3))
    train, _ = text_datasets(str(path), None, tokenizer, DocSettings("chat", 2048, True),
                             str(root / "cache"), 10_000, preparer=True)
    supervised, real = (int(x) for x in train.counts.sum(axis=0))
    window = train.num_windows * train.seq_len
    return {"conversations": chats, "windows": train.num_windows, "real_share": real / window,
            "supervised_share": supervised / window}


def run_steps(root: Path, name: str, overrides: list[str], steps: int) -> dict:
    run_dir = root / name
    command = [sys.executable, "-m", "trainer", f"train.steps={steps}", "logging.every=1",
               "logging.wandb=false", "logging.progress=false", f"train.eval_every={steps}",
               "train.eval_batches=1", "data.seq_len=256", "train.micro_batch_size=8",
               "model.vocab_size=320", f"hydra.run.dir={run_dir}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(command, check=True, capture_output=True, env=env)
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    logged = [r for r in records if "step_time_s" in r]
    return {"step_s": statistics.median(r["step_time_s"] for r in logged[3:]),
            "peak_rss_gib": max(r["peak_mem_bytes"] for r in logged) / 2**30}


def bench_steps(root: Path, tokenizer: str, steps: int, chats: int) -> dict:
    small = write_jsonl(root / "small.jsonl", chat_records(chats // 10, seed=4))
    large = write_jsonl(root / "large.jsonl", chat_records(chats, seed=5))
    chat = ["data=chat", f"data.tokenizer={tokenizer}", f"data.cache_dir={root / 'cache'}"]
    out = {"synthetic": run_steps(root, "synthetic", ["data=synthetic"], steps),
           "chat": run_steps(root, "chat", [*chat, f"data.path={small}"], steps),
           "chat_10x": run_steps(root, "chat10", [*chat, f"data.path={large}"], steps)}
    out["ratio"] = out["chat"]["step_s"] / out["synthetic"]["step_s"]
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.bench.data",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--text-mb", type=float, default=100.0)
    parser.add_argument("--chats", type=int, default=20000)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", default=None, help="keep the files here (default: a temp dir)")
    args = parser.parse_args(argv)
    root = Path(args.out or tempfile.mkdtemp(prefix="blocktrain-data-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = str(make_tokenizer(root / "tokenizer"))
    t = bench_tokenize(root, tokenizer, args.text_mb)
    print(f"tokenize {t['mb']:.0f} MB jsonl: {t['documents']:,} documents, {t['tokens']:,} "
          f"tokens in {t['tokenize_s']:.1f} s ({t['docs_per_s']:,.0f} docs/s, "
          f"{t['tokens_per_s']:,.0f} tokens/s); prepared (tokenized, packed, written) in "
          f"{t['first_start_s']:.1f} s, a second start "
          f"{t['second_start_s']:.2f} s (cached)")
    p = bench_packing(root, tokenizer, args.chats)
    print(f"pack {p['conversations']:,} chats best-fit into {p['windows']:,} windows of 2048: "
          f"{p['real_share']:.1%} of window tokens real, {p['supervised_share']:.1%} supervised")
    s = bench_steps(root, tokenizer, args.steps, args.chats)
    print(f"tiny model, {args.steps} steps: data=synthetic {s['synthetic']['step_s'] * 1e3:.1f} "
          f"ms/step, data=chat {s['chat']['step_s'] * 1e3:.1f} ms/step ({s['ratio']:.3f}x); "
          f"peak RSS {s['chat']['peak_rss_gib']:.2f} GiB with {args.chats // 10:,} chats, "
          f"{s['chat_10x']['peak_rss_gib']:.2f} GiB with {args.chats:,}")


if __name__ == "__main__":
    main()
