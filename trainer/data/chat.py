"""Conversations to tokens with the tokenizer's own chat template, and which tokens to learn.

`data.train_on=assistant` supervises every assistant turn (its text and the end marker the
template puts after it), `last` only the final assistant turn, `all` every token. Every other
label is the ignore index (-100).

Where the template marks assistant spans itself (`{% generation %}`), its mask is used. Other
templates are read turn by turn: the conversation up to an assistant turn, templated with the
generation prompt, must be an exact token prefix of the whole conversation, and so must the
conversation through that turn; the tokens between the two are the turn. A template for which
that does not hold (one that rewrites earlier turns, say) cannot say which tokens are the
assistant's, and is refused in one line.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

IGNORE = -100  # the label of a token the loss skips (torch's cross_entropy default)
TRAIN_ON = ("assistant", "last", "all")


class ChatError(ValueError):
    """A record or template the chat data cannot use; the message names the setting."""


def messages_of(record: Mapping[str, Any], messages_field: str, prompt_field: str,
                completion_field: str) -> list[dict]:
    """The conversation of a record: its `messages` list, or a prompt/completion pair as one
    user and one assistant turn."""
    if messages_field in record and record[messages_field] is not None:
        messages = record[messages_field]
        if not isinstance(messages, list) or not all(
                isinstance(m, Mapping) and "role" in m and "content" in m for m in messages):
            raise ChatError(f"data.messages_field: {messages_field!r} must be a list of "
                            "{role, content} turns")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    if prompt_field in record and completion_field in record:
        return [{"role": "user", "content": record[prompt_field]},
                {"role": "assistant", "content": record[completion_field]}]
    raise ChatError(f"data.messages_field: a record has neither {messages_field!r} nor "
                    f"{prompt_field!r}/{completion_field!r}; its fields: {', '.join(record)}")


def _ids(tokenizer, messages: Sequence[dict], generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(list(messages), tokenize=True,
                                        add_generation_prompt=generation_prompt,
                                        return_dict=True)
    return list(out["input_ids"])


def _marked_spans(tokenizer, messages: Sequence[dict]) -> Optional[tuple[list[int], list[int]]]:
    """(ids, assistant mask) from a template with `{% generation %}` markers, else None."""
    template = tokenizer.chat_template or ""
    if "{% generation %}" not in template and "{%- generation %}" not in template:
        return None
    out = tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def _turn_spans(tokenizer, messages: Sequence[dict], ids: list[int]) -> list[tuple[int, int]]:
    """[start, end) token spans of each assistant turn, by templated prefixes."""
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _ids(tokenizer, messages[:k], generation_prompt=True)
        through = _ids(tokenizer, messages[:k + 1], generation_prompt=False)
        if ids[:len(before)] != before or ids[:len(through)] != through:
            raise ChatError(
                "data.tokenizer: its chat template does not template a conversation as the "
                "sum of its turns (a prefix of the conversation is not a token prefix of the "
                "whole), so the assistant's tokens cannot be told apart; use a template with "
                "{% generation %} markers, or data.train_on=all")
        spans.append((len(before), len(through)))
    return spans


def _trim_after_end(ids: list[int], start: int, end: int, end_ids: set[int]) -> int:
    """The turn ends with its end marker (e.g. <|im_end|>): what the template adds after it
    (a newline) is layout, not the assistant's to learn."""
    for i in range(end - 1, start - 1, -1):
        if ids[i] in end_ids:
            return i + 1
    return end


def chat_tokens(tokenizer, messages: Sequence[dict], train_on: str) -> tuple[list[int], list[bool]]:
    """(token ids, supervised per token) of one conversation."""
    if train_on == "all":
        ids = _ids(tokenizer, messages, generation_prompt=False)
        return ids, [True] * len(ids)
    marked = _marked_spans(tokenizer, messages)
    if marked is not None:
        ids, mask = marked
        supervised = [bool(m) for m in mask]
        spans = _runs(supervised)
    else:
        ids = _ids(tokenizer, messages, generation_prompt=False)
        end_ids = {i for i in (tokenizer.eos_token_id,) if i is not None}
        spans = [(s, _trim_after_end(ids, s, e, end_ids))
                 for s, e in _turn_spans(tokenizer, messages, ids)]
    if train_on == "last":
        spans = spans[-1:]
    supervised = [False] * len(ids)
    for start, end in spans:
        supervised[start:end] = [True] * (end - start)
    return ids, supervised


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
