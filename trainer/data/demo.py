"""Local text and chat data for demos, benchmarks and tests: a small byte-level BPE tokenizer
with a ChatML template, tokenizers shaped like real models' chat templates (Llama-2, Mistral,
Llama-3, Gemma, Phi-3, ChatML with generation marks; all built here with `tokenizers`, no
download), generated records, and jsonl / parquet writers."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Iterable, Optional

from trainer.config import DataConfig

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


def make_small_tokenizer(folder: Path, vocab_size: int = 256) -> Path:
    """A ChatML tokenizer that fits the built-in tiny model's 256 ids: byte-level BPE over
    printable ASCII and newline only (any other byte is <unk>), eos <|im_end|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from trainer.data.run_tokenizer import byte_chars

    chars = byte_chars()
    alphabet = [chars[b] for b in (10, *range(32, 127))]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[*SPECIALS, "<unk>"],
                                  initial_alphabet=alphabet, limit_alphabet=len(alphabet),
                                  show_progress=False)
    tok.train_from_iterator([" ".join(WORDS)] * 50, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<unk>")
    fast.chat_template = CHATML
    fast.save_pretrained(str(folder))
    return folder


DEMO = "demo"  # data.path=demo: the demo set below, made on first use
DEMO_VERSION = "v1"  # a new version when what the demo files hold changes


def with_demo(d: DataConfig, own_tokenizer: Optional[str], chats: bool) -> DataConfig:
    """data.path=demo (data=text or chat; its DocumentSource asks): `d` reading the demo set
    written under data.cache_dir (demo/<version>/: text.jsonl or, with `chats`, chats.jsonl,
    and a small ChatML tokenizer that the default model's vocabulary holds, used unless
    data.tokenizer or the model's own is set); any other `d` as it is."""
    if d.path != DEMO:
        return d
    from trainer.data.documents import default_cache_dir

    root = Path(d.cache_dir or default_cache_dir()) / DEMO / DEMO_VERSION
    if chats:
        path = _write_once(root / "chats.jsonl", lambda p: write_jsonl(p, chat_records(400)))
    else:
        path = _write_once(root / "text.jsonl", lambda p: write_jsonl(p, text_records(2000)))
    tokenizer = d.tokenizer or own_tokenizer
    if tokenizer is None:
        tokenizer = str(_write_once(root / "tokenizer", make_small_tokenizer))
    return replace(d, path=str(path), tokenizer=tokenizer)


def _write_once(path: Path, write) -> Path:
    """`path` as `write` makes it, made once: in a temporary sibling, then renamed (a process
    starting beside this one sees the whole file or folder, or none)."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-"))
    write(work / path.name)
    try:
        os.rename(work / path.name, path)
    except OSError:  # another process made it first
        if not path.exists():
            raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return path


# Chat templates in the shapes of real models' (simplified; contents rendered as real ones do).
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
          "{% set turns = messages[1:] %}{% else %}{% set system = '' %}"
          "{% set turns = messages %}{% endif %}{% for m in turns %}{% if m['role'] == 'user' %}"
          "{{ bos_token }}[INST] {% if loop.first and system %}<<SYS>>\n{{ system }}\n<</SYS>>"
          "\n\n{% endif %}{{ m['content'] | trim }} [/INST]{% else %} {{ m['content'] | trim }} "
          "{{ eos_token }}{% endif %}{% endfor %}")
MISTRAL = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
           "{{ '[INST] ' + m['content'] + ' [/INST]' }}{% elif m['role'] == 'assistant' %}"
           "{{ m['content'] + eos_token }}{% endif %}{% endfor %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
          "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
          "{% endif %}")
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
         "{% set first = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
         "{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
         "{% for m in turns %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
         "<start_of_turn>{{ role }}\n{{ (first if loop.first else '') + m['content'] | trim }}"
         "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
         "{% endif %}")
PHI3 = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}"
        "{{ eos_token }}{% endif %}")
CHATML_MARKED = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                 "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n"
                 "{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# shape: (template, pieces, special tokens, bos, eos). Pieces: "bytes" (byte-level BPE, GPT-2 /
# Llama-3 style), "metaspace" (SentencePiece style: spaces as ▁, one word per text so pieces
# may merge across a turn's boundary), "gemma" (spaces replaced by ▁, no pre-tokenizer).
SHAPES = {
    "llama2": (LLAMA2, "metaspace", ["<unk>", "<s>", "</s>"], "<s>", "</s>"),
    "mistral": (MISTRAL, "metaspace", ["<unk>", "<s>", "</s>"], "<s>", "</s>"),
    "llama3": (LLAMA3, "bytes", ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                 "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", "<|eot_id|>"),
    "gemma": (GEMMA, "gemma", ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>",
                               "<end_of_turn>"], "<bos>", "<eos>"),
    "phi3": (PHI3, "metaspace", ["<unk>", "<s>", "<|endoftext|>", "<|system|>", "<|user|>",
                                 "<|assistant|>", "<|end|>"], "<s>", "<|endoftext|>"),
    "chatml": (CHATML, "bytes", SPECIALS, None, "<|im_end|>"),
    "chatml_marked": (CHATML_MARKED, "bytes", SPECIALS, None, "<|im_end|>"),
}


def make_shaped_tokenizer(folder: Path, shape: str, vocab_size: int = 400,
                          corpus: Optional[Iterable[str]] = None) -> Path:
    """A tokenizer folder with the template and special tokens of `shape` (SHAPES), its pieces
    learned from conversations rendered with that template (so merges across a turn's boundary
    are learned where the template joins text without a space, as real vocabularies do), or
    from the texts of `corpus` (a benchmark's: a real vocabulary's size needs more text)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    template, pieces, specials, bos, eos = SHAPES[shape]
    alphabet = [chr(c) for c in range(32, 127)] + ["\n", "▁"]
    tok = Tokenizer(models.BPE(unk_token=None if pieces == "bytes" else "<unk>"))
    if pieces == "bytes":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    elif pieces == "metaspace":  # pieces learned word by word, each beginning with its ▁
        tok.pre_tokenizer = pre_tokenizers.Metaspace("▁", prepend_scheme="first", split=True)
        tok.decoder = decoders.Metaspace("▁", prepend_scheme="first", split=False)
    else:
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.decoder = decoders.Replace("▁", " ")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator(_rendered_corpus(template, specials) if corpus is None else corpus,
                            trainer)
    if pieces == "metaspace":  # then read whole texts, as converted SentencePiece models do
        tok.pre_tokenizer = pre_tokenizers.Metaspace("▁", prepend_scheme="first", split=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                   unk_token=None if pieces == "bytes" else "<unk>")
    fast.chat_template = template
    fast.save_pretrained(str(folder))
    return folder


def _rendered_corpus(template: str, specials: list[str]) -> list[str]:
    """Conversations rendered with `template`, special tokens left out (they are never merged)."""
    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = lambda message: None
    render = env.from_string(template.replace("{% generation %}", "").replace(
        "{% endgeneration %}", ""))
    out = []
    for record in chat_records(200, seed=1):
        text = render.render(messages=record["messages"], bos_token="", eos_token="",
                             add_generation_prompt=False)
        for special in specials:
            text = text.replace(special, " ")
        out.append(text)
    return out


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
