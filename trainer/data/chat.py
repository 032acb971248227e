"""Conversations to tokens with the tokenizer's own chat template, and which tokens to learn.

`data.train_on=assistant` supervises every assistant turn (its text and the end marker the
template puts after it), `last` only the final assistant turn, `all` every token. Every other
label is the ignore index (-100).

Which tokens are a turn's is found in the first of three ways that holds:
1. the template marks assistant spans itself (`{% generation %}`): its mask;
2. the conversation up to an assistant turn, templated with the generation prompt, is an exact
   token prefix of the whole, and so is the conversation through that turn: the tokens between
   the two, up to the turn's last eos;
3. any template that renders each message's content verbatim (or trimmed): the conversation is
   rendered as text, each assistant message's content found in it in order, and mapped to tokens
   with the fast tokenizer's offsets; the turn's end marker is what follows the content up to and
   including the first special token (e.g. `</s>`, `<|eot_id|>`, `<end_of_turn>`).
1 and 2 are what tokenizers that merge across a turn's boundary (SentencePiece `[INST]`
templates) fail; 3 is the fallback. Every conversation's spans are checked before they are used
(trainer/data/chat_check.py): each turn's tokens decode to its content plus its end marker. A
mask from 1 or 2 that fails the check is not used (3 is); where 3 cannot find a content in the
rendered text, the record is refused in one line naming it. A tokenizer without character
offsets (not a fast one) has 1 and 2 only, unchecked, as before.
"""

from __future__ import annotations

from typing import Optional, Sequence

from trainer.data.chat_check import (ChatError, Rendered, render, turn_end, turn_problem,
                                     turn_start, turns_located)

IGNORE = -100  # the label of a token the loss skips (torch's cross_entropy default)
TRAIN_ON = ("assistant", "last", "all")


def _ids(tokenizer, messages: Sequence[dict], generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(list(messages), tokenize=True,
                                        add_generation_prompt=generation_prompt,
                                        return_dict=True)
    return list(out["input_ids"])


def _marked_spans(tokenizer, messages: Sequence[dict]):
    """(ids, assistant spans) from a template with `{% generation %}` markers, else None."""
    template = tokenizer.chat_template or ""
    if "{% generation %}" not in template and "{%- generation %}" not in template:
        return None
    out = tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    return list(out["input_ids"]), _runs([bool(m) for m in out["assistant_masks"]])


def _prefix_spans(tokenizer, messages: Sequence[dict], ids: list[int]):
    """(ids, assistant spans) by templated prefixes of the conversation whose tokens are `ids`,
    else None (a prefix of the conversation is not a token prefix of the whole)."""
    end_ids = {i for i in (tokenizer.eos_token_id,) if i is not None}
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _ids(tokenizer, messages[:k], generation_prompt=True)
        through = _ids(tokenizer, messages[:k + 1], generation_prompt=False)
        if ids[:len(before)] != before or ids[:len(through)] != through:
            return None
        spans.append((len(before), _trim_after_end(ids, len(before), len(through), end_ids)))
    return ids, spans


def _trim_after_end(ids: list[int], start: int, end: int, end_ids: set[int]) -> int:
    """The turn ends with its end marker (e.g. <|im_end|>): what the template adds after it
    (a newline) is layout, not the assistant's to learn."""
    for i in range(end - 1, start - 1, -1):
        if ids[i] in end_ids:
            return i + 1
    return end


def _offset_spans(tokenizer, messages: Sequence[dict], shown: Rendered, needed: set[int],
                  where: str, prompts: Optional[dict] = None) -> list[Optional[tuple[int, int]]]:
    """Each assistant turn's [start, end) tokens from where its content is in the rendered
    text; None for a turn not found (refused when `needed`, unless it is empty). `prompts`:
    see chat_check.turns_located."""
    contents = [m["content"] for m in messages if m["role"] == "assistant"]
    places = turns_located(tokenizer, messages, shown.text, prompts)
    spans: list[Optional[tuple[int, int]]] = []
    for k, place in enumerate(places):
        if place is None:
            if k in needed and contents[k].strip():
                raise ChatError(
                    f"data.tokenizer: its chat template does not render assistant turn {k + 1} "
                    f"of {where} ({contents[k][:40]!r}) as it is, so its tokens cannot be "
                    "found; fix the record or the template, or set data.train_on=all")
            spans.append(None)
            continue
        later = [p for p in places[k + 1:] if p is not None]
        bound = later[0][0] if later else len(shown.text)
        start = turn_start(shown, place)
        spans.append((start, turn_end(shown, start, place[1], bound)[0]))
    return spans


def _spans(tokenizer, messages: Sequence[dict], shown: Rendered, needed: set[int],
           where: str) -> list[Optional[tuple[int, int]]]:
    """The spans of the first way that holds and whose `needed` turns pass the check."""
    contents = [m["content"] for m in messages if m["role"] == "assistant"]
    for way in (lambda: _marked_spans(tokenizer, messages),
                lambda: _prefix_spans(tokenizer, messages, shown.ids)):
        got = way()
        if got is None or got[0] != shown.ids or len(got[1]) != len(contents):
            continue
        if shown.offsets is None or turn_problem(
                tokenizer, shown, [got[1][k] for k in sorted(needed)],
                [contents[k] for k in sorted(needed)]) is None:
            return list(got[1])
    if shown.offsets is None:
        raise ChatError(
            "data.tokenizer: its chat template does not template a conversation as the sum of "
            "its turns (a prefix of the conversation is not a token prefix of the whole), and "
            "it is no fast tokenizer, whose offsets would find the assistant's tokens; use a "
            "template with {% generation %} markers, or data.train_on=all")
    return offset_spans(tokenizer, messages, shown, needed, where)


def offset_spans(tokenizer, messages: Sequence[dict], shown: Rendered, needed: set[int],
                 where: str, prompts: Optional[dict] = None) -> list[Optional[tuple[int, int]]]:
    """The spans of way 3, checked; ChatError naming `where` when they fail."""
    contents = [m["content"] for m in messages if m["role"] == "assistant"]
    spans = _offset_spans(tokenizer, messages, shown, needed, where, prompts)
    checked = [k for k in sorted(needed) if spans[k] is not None]
    problem = turn_problem(tokenizer, shown, [spans[k] for k in checked],
                           [contents[k] for k in checked])
    if problem is not None:
        raise ChatError(f"data.tokenizer: the assistant tokens of {where} do not decode to "
                        f"its text ({problem}); set data.train_on=all")
    return spans


def needed_turns(messages: Sequence[dict], train_on: str) -> set[int]:
    """The assistant turns (counted among assistant turns) whose tokens are learned."""
    turns = sum(1 for m in messages if m["role"] == "assistant")
    # train_on=last learns only the final turn, so only it need be found and checked.
    return set(range(turns)) if train_on == "assistant" else {turns - 1} - {-1}


def supervised_mask(length: int, spans: Sequence[Optional[tuple[int, int]]],
                    needed: set[int]) -> list[bool]:
    supervised = [False] * length
    for k in needed:
        if spans[k] is not None:
            start, end = spans[k]
            supervised[start:end] = [True] * (end - start)
    return supervised


def chat_tokens(tokenizer, messages: Sequence[dict], train_on: str,
                where: str = "a conversation") -> tuple[list[int], list[bool]]:
    """(token ids, supervised per token) of one conversation; `where` names it in errors."""
    if train_on == "all":
        ids = _ids(tokenizer, messages, generation_prompt=False)
        return ids, [True] * len(ids)
    shown = render(tokenizer, messages)
    needed = needed_turns(messages, train_on)
    turns = sum(1 for m in messages if m["role"] == "assistant")
    spans = _spans(tokenizer, messages, shown, needed, where) if turns else []
    return list(shown.ids), supervised_mask(len(shown.ids), spans, needed)


def _runs(flags: Sequence[bool]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, flag in enumerate(list(flags) + [False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            spans.append((start, i))
            start = None
    return spans


def check_template(tokenizer, name: str) -> None:
    """One line for a tokenizer that has no chat template at all."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatError(f"data.tokenizer: {name} has no chat template (tokenizer_config.json "
                        "'chat_template'); data=chat formats conversations with it")
