"""Local text and chat data for demos, benchmarks and tests: a small byte-level BPE tokenizer
with a ChatML template (built here with `tokenizers`, no download), generated records, and
jsonl / parquet writers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
          "{{ message['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex "
         "jovial zebras and packing boxes of liquor jugs").split()


def make_tokenizer(folder: Path, vocab_size: int = 300, template: Optional[str] = CHATML) -> Path:
    """A byte-level BPE tokenizer folder AutoTokenizer loads; eos is <|im_end|> (ChatML)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([" ".join(WORDS)] * 50, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    if template:
        fast.chat_template = template
    fast.save_pretrained(str(folder))
    return folder


def text_records(n: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    return [{"id": i, "text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))}
            for i in range(n)]


def chat_records(n: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)

    def say(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, k)))

    records = []
    for i in range(n):
        turns = [{"role": "system", "content": say(6)}]
        for _ in range(rng.randint(1, 3)):
            turns += [{"role": "user", "content": say(12)},
                      {"role": "assistant", "content": say(20)}]
        records.append({"id": i, "messages": turns})
    return records


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_parquet(path: Path, records: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), str(path))
    return path
