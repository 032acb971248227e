"""Where a conversation's assistant turns are in its rendered text and tokens, and the check every
conversation's mask passes before it is used (trainer/data/chat.py).

The check, turn by turn: the content (as given, or trimmed, as templates often render it) starts
inside the turn's first token, and the turn's tokens decode to the rendered text from that token
to the end marker: the content, then what follows it up to and including the first special token
(`</s>`, `<|im_end|>`, `<|eot_id|>`, ...), none where no special token comes before the next
assistant turn. Decoded and rendered text are compared exactly (special tokens included, spaces
not cleaned up) except for whitespace at either end (SentencePiece decoders drop the space that
begins a first token, and a `{% generation %}` block may hold the newline after the end marker)
and for what the tokenizer's own normalizer changes (Qwen2's NFC, say): text it normalises is
compared normalised.
Where the tokenizer merges template text into the turn's first token (`[/INST]seven` as one
SentencePiece piece, ` seven` as one byte-level token after a template's space), those characters
are in the rendered text the turn is compared with: the token is learned whole, as transformers'
own assistant masks do.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence


class ChatError(ValueError):
    """A record or template the chat data cannot use; the message names the setting."""


@dataclass(frozen=True)
class Rendered:
    """A conversation as the template renders it, and its tokens with their characters."""
    text: str
    ids: list[int]
    offsets: Optional[list[tuple[int, int]]]  # None: a tokenizer without offsets (not fast)
    specials: frozenset[int]

    @cached_property
    def _columns(self) -> tuple[list[int], list[int]]:
        begins, ends = zip(*self.offsets) if self.offsets else ((), ())
        return list(begins), list(ends)

    @property
    def begins(self) -> list[int]:
        return self._columns[0]

    @property
    def ends(self) -> list[int]:
        return self._columns[1]

    @cached_property
    def in_order(self) -> bool:
        """Whether the tokens' begins and ends never go back (as a fast tokenizer's offsets
        do): then a turn's first and last tokens are found by bisection, not a scan."""
        return self.begins == sorted(self.begins) and self.ends == sorted(self.ends)


def special_ids(tokenizer) -> frozenset[int]:
    """The ids that can end a turn: the special tokens (eos, end-of-turn, ...), not unk."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return frozenset((set(tokenizer.all_special_ids)
                      | {i for i, token in added.items() if getattr(token, "special", False)})
                     - {tokenizer.unk_token_id})


def render(tokenizer, messages: Sequence[dict]) -> Rendered:
    """The text of the conversation and its tokens as apply_chat_template makes them (the text
    tokenized without added special tokens), with each token's characters."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False)
    try:
        out = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = [tuple(o) for o in out["offset_mapping"]]
    except NotImplementedError:  # a Python tokenizer has no offsets
        out, offsets = tokenizer(text, add_special_tokens=False), None
    return Rendered(text, list(out["input_ids"]), offsets, special_ids(tokenizer))


def find_content(text: str, content: str, start: int,
                 before: Optional[int] = None) -> Optional[tuple[int, int]]:
    """[begin, end) characters of `content` (as given, else trimmed) in `text` from `start`;
    with `before`, only a place that begins before it."""
    for needle in dict.fromkeys((content, content.strip())):
        at = text.find(needle, start)
        if at >= 0 and (before is None or at < before):
            return at, at + len(needle)
    return None


def turn_start(shown: Rendered, place: tuple[int, int]) -> int:
    """The first token of a turn whose content is at `place`: the one holding its first
    character (the token at its place, for an empty content)."""
    if place[1] > place[0]:
        holder = bisect_right(shown.ends, place[0]) if shown.in_order else len(shown.ids)
        if holder < len(shown.ids):
            return holder
        return next(j for j, (_, end) in enumerate(shown.offsets) if end > place[0])
    if shown.in_order:
        return bisect_left(shown.begins, place[0])
    return next((j for j, (begin, _) in enumerate(shown.offsets) if begin >= place[0]),
                len(shown.ids))


def turn_end(shown: Rendered, start: int, content_end: int, bound: int) -> tuple[int, int]:
    """(token, character) just past a turn whose content ends at `content_end`: past its end
    marker, the first special token after the content that begins before `bound` (the next
    assistant turn); with none, past the token holding the content's last character."""
    if shown.in_order:  # the tokens before the content's end, then those up to `bound`
        last = min(bisect_left(shown.begins, content_end, lo=start),
                   bisect_left(shown.begins, bound, lo=start))
        for j in range(last, bisect_left(shown.begins, bound, lo=last)):
            if shown.ids[j] in shown.specials:
                return j + 1, shown.ends[j]
        return last, (shown.ends[last - 1] if last > start else content_end)
    last = start
    for j in range(start, len(shown.ids)):
        begin, end = shown.offsets[j]
        if begin >= bound:
            break
        if begin >= content_end and shown.ids[j] in shown.specials:
            return j + 1, end
        if begin < content_end:
            last = j + 1
    return last, (shown.offsets[last - 1][1] if last > start else content_end)


def turn_problem(tokenizer, shown: Rendered, spans: Sequence[tuple[int, int]],
                 contents: Sequence[str]) -> Optional[str]:
    """None when every span is its turn's content and end marker (see the module docstring),
    else what is wrong with the first that is not."""
    for k, ((start, end), content) in enumerate(zip(spans, contents)):
        if not 0 <= start < end <= len(shown.ids):
            return f"assistant turn {k + 1} has no tokens"
        first_begin, first_end = shown.offsets[start]
        place = find_content(shown.text, content, first_begin, before=max(first_end,
                                                                           first_begin + 1))
        if place is None:
            return f"assistant turn {k + 1} does not begin with its content {content[:40]!r}"
        later = [s for s, _ in spans[k + 1:]]
        bound = shown.offsets[later[0]][0] if later else len(shown.text)
        _, marker_end = turn_end(shown, start, place[1], bound)
        if _spelled_out(shown, start, end, first_begin, marker_end, tokenizer.unk_token_id):
            continue  # the offsets prove what decoding would show: skip the decode
        expected = shown.text[first_begin:marker_end]
        decoded = tokenizer.decode(shown.ids[start:end], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
        if not _same_text(tokenizer, decoded, expected):
            return f"assistant turn {k + 1} decodes to {decoded[:80]!r}, not {expected[:80]!r}"
    return None


def _spelled_out(shown: Rendered, start: int, end: int, begin: int, stop: int,
                 unk: Optional[int]) -> bool:
    """Whether tokens [start, end) are characters [begin, stop) of the text one after another
    (each token's characters begin where the last's end; none is unknown): then they decode to
    that text, and the check needs no decode. Tokens that share characters (byte pieces of one
    character, byte fallback) or skip some (a trimmed offset) are left to the decode."""
    offsets = shown.offsets
    if offsets[start][0] != begin or offsets[end - 1][1] != stop:
        return False
    if unk is not None and unk in shown.ids[start:end]:
        return False
    return shown.begins[start + 1:end] == shown.ends[start:end - 1]


def _same_text(tokenizer, decoded: str, rendered: str) -> bool:
    """Equal but for whitespace at either end, and for what the tokenizer's normalizer does."""
    decoded, rendered = decoded.strip(), rendered.strip()
    if decoded == rendered:
        return True
    backend = getattr(tokenizer, "backend_tokenizer", None)
    normalizer = getattr(backend, "normalizer", None)
    return normalizer is not None and (normalizer.normalize_str(decoded)
                                       == normalizer.normalize_str(rendered))


def turns_located(tokenizer, messages: Sequence[dict], text: str,
                  prompts: Optional[dict] = None) -> list:
    """[begin, end) characters of each assistant message's content in `text`, in order (None
    where it is not there). Each search starts after the conversation up to the turn rendered
    with the generation prompt, when that is a prefix of the text, so a content that also
    appears earlier (quoted by the user) is not taken for the turn; else after the contents
    found before it. `prompts`: those renders already made (message index -> text, or None
    where the template refused), as a batch renders them (trainer/data/chat_batch.py)."""
    places, pos = [], 0
    for k, message in enumerate(messages):
        content = message["content"]
        if message["role"] != "assistant":
            place = find_content(text, content, pos) if content.strip() else None
            pos = place[1] if place else pos
            continue
        head = (_prompt_end(tokenizer, messages[:k], text) if prompts is None
                else _ends_at(prompts.get(k), text))
        start = head if head is not None else pos
        if content.strip():
            place = find_content(text, content, start)
        else:  # nothing to find: its place is where the generation prompt ends, when known
            place = (head, head) if head is not None else None
        places.append(place)
        pos = place[1] if place else pos
    return places


def _prompt_end(tokenizer, head: Sequence[dict], text: str) -> Optional[int]:
    """Where the text of `head` with the generation prompt ends, if it is a prefix of `text`."""
    try:
        prompt = tokenizer.apply_chat_template(list(head), tokenize=False,
                                               add_generation_prompt=True)
    except Exception:  # a template may refuse a partial conversation: then search on from pos
        return None
    return _ends_at(prompt, text)


def _ends_at(prompt: Optional[str], text: str) -> Optional[int]:
    return len(prompt) if prompt is not None and text.startswith(prompt) else None
