"""Benchmark the preparation of chat and text data against the plain library call, in one run.

    python -m launch.bench.data_prep [--chats 4000] [--texts 20000] [--repeats 3]

For each template (ChatML, a Llama-3-style one, a SentencePiece `[INST]` one: trainer/data/demo.py
builds their tokenizers here, no download) and for `data=text`, on the same records, in turns
(each repeat runs every contender once, so a load that comes and goes falls on all of them):

- `plain`: the library's own calls a user would write, per batch of 256: one
  `apply_chat_template(batch, tokenize=False)` and one `tokenizer(texts,
  return_offsets_mapping=True)` (text: `tokenizer(texts)`); no masks.
- `ours`: blocktrain's preparation (trainer/data/tokenize_docs.py's `tokenize`: `datasets`' map
  over the records, assistant masks checked, bad records named), `data.num_proc` 1 and 2.
- `before` (chat, the first 300 records): the per-conversation way (trainer/data/chat.py's
  `chat_tokens`), which the preparation used until 2026-12-04.

Each figure is the best of --repeats: conversations/s and tokens/s, and ours over plain. The
tokenizers are small (400 ids); real ones tokenize slower, which makes the fixed costs ours adds
a smaller share.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

BATCH = 256
TEMPLATES = ("chatml", "llama3", "mistral")  # mistral: the SentencePiece [INST] shape


def _plain_chat(tokenizer, conversations: list) -> int:
    tokens = 0
    for at in range(0, len(conversations), BATCH):
        texts = tokenizer.apply_chat_template(conversations[at:at + BATCH], tokenize=False)
        out = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        tokens += sum(len(ids) for ids in out["input_ids"])
    return tokens


def _plain_text(tokenizer, texts: list) -> int:
    tokens = 0
    for at in range(0, len(texts), BATCH):
        tokens += sum(len(ids) for ids in tokenizer(texts[at:at + BATCH])["input_ids"])
    return tokens


def _ours(records, tokenizer, kind: str, num_proc: int) -> int:
    from trainer.data.sources import DocSettings
    from trainer.data.tokenize_docs import tokenize

    docs = tokenize(records, tokenizer, DocSettings(kind, 2048), None, "bench", num_proc)
    return int(sum(docs["length"]))


def _before(tokenizer, conversations: list) -> int:
    from trainer.data.chat import chat_tokens

    return sum(len(chat_tokens(tokenizer, m, "assistant")[0]) for m in conversations)


def _timed(run) -> tuple[float, int]:
    started = time.perf_counter()
    tokens = run()
    return time.perf_counter() - started, tokens


def bench_one(name: str, tokenizer, records, rows: list, repeats: int) -> dict:
    """Best seconds and tokens of each contender on `records` (a datasets.Dataset of `rows`)."""
    kind = "text" if name == "text" else "chat"
    payload = ([r["text"] for r in rows] if kind == "text"
               else [r["messages"] for r in rows])
    contenders = {
        "plain": lambda: (_plain_text if kind == "text" else _plain_chat)(tokenizer, payload),
        "ours_1": lambda: _ours(records, tokenizer, kind, 1),
        "ours_2": lambda: _ours(records, tokenizer, kind, 2),
    }
    if kind == "chat":
        contenders["before"] = lambda: _before(tokenizer, payload[:300])
    best: dict = {}
    for _ in range(repeats):
        for label, run in contenders.items():
            seconds, tokens = _timed(run)
            if label not in best or seconds < best[label][0]:
                best[label] = (seconds, tokens)
    count = {label: (300 if label == "before" else len(rows)) for label in best}
    return {label: {"s": s, "tokens": t, "docs_per_s": count[label] / s, "tokens_per_s": t / s}
            for label, (s, t) in best.items()}


def _records(root: Path, name: str, chats: int, texts: int):
    import datasets

    from trainer.data.demo import chat_records, text_records, write_jsonl

    rows = text_records(texts, seed=1) if name == "text" else chat_records(chats, seed=1)
    if name == "mistral":  # its template has no place for a system prompt
        rows = [{**r, "messages": r["messages"][1:]} for r in rows]
    path = write_jsonl(root / f"{name}.jsonl", rows)
    return datasets.load_dataset("json", data_files=str(path), split="train",
                                 cache_dir=str(root / "hf")), rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m launch.bench.data_prep",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--chats", type=int, default=4000)
    parser.add_argument("--texts", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    import datasets
    from transformers import AutoTokenizer

    from trainer.data.demo import make_shaped_tokenizer

    datasets.disable_progress_bars()
    root = Path(tempfile.mkdtemp(prefix="blocktrain-data-prep-"))
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start; "
          f"best of {args.repeats}; {args.chats:,} conversations, {args.texts:,} texts")
    print(f"{'data':<8} {'who':<8} {'docs/s':>9} {'tokens/s':>11} {'vs plain':>9}")
    for name in (*TEMPLATES, "text"):
        tokenizer = AutoTokenizer.from_pretrained(str(make_shaped_tokenizer(
            root / f"tok_{name}", "chatml" if name == "text" else name)))
        records, rows = _records(root, name, args.chats, args.texts)
        result = bench_one(name, tokenizer, records, rows, args.repeats)
        plain = result["plain"]["tokens_per_s"]
        for label, row in result.items():
            print(f"{name:<8} {label:<8} {row['docs_per_s']:>9,.0f} {row['tokens_per_s']:>11,.0f} "
                  f"{row['tokens_per_s'] / plain:>8.0%}")
        print(f"{name:<8} num_proc 2 / 1: {result['ours_1']['s'] / result['ours_2']['s']:.2f}x")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
