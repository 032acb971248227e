"""The tokenizer a run's text went through, for reading its model back (trainer.generate, the
export folder), loaded here once trainer.data.factory.tokenizer_of_run has named it; BYTES is a
tokenizer whose ids are the bytes themselves (built here, nothing downloaded)."""

from __future__ import annotations

BYTES = "bytes"  # the run read raw bytes (data=bytes): token id = byte value


def byte_chars() -> dict[int, str]:
    """Byte -> the printable character byte-level tokenizers write it as: printable Latin-1
    bytes stand for themselves, the others take characters from 256 up, in byte order."""
    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in kept}
    chars.update({b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in kept)})
    return chars


def byte_tokenizer():
    """A transformers tokenizer whose 256 ids are the UTF-8 bytes of the text (no merges, no
    special tokens): what data=bytes trains on, in a form AutoTokenizer saves and loads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: byte for byte, char in byte_chars().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def load_run_tokenizer(name: str):
    """The tokenizer `tokenizer_of_run` named (BYTES: the byte tokenizer), from local files."""
    if name == BYTES:
        return byte_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)
