"""Conversations to tokens a batch at a time, at the speed of the library's own calls.

A batch of conversations is rendered by one `apply_chat_template` call and tokenized by one
call of the fast tokenizer with character offsets; each assistant turn's tokens are then found
from the offsets (trainer/data/chat.py's way 3), the renders of the conversation up to each turn
with the generation prompt (where each turn's search starts) made in one more call for the whole
batch, text only. The check that a turn's tokens are its text reads the offsets, and decodes
only where they cannot prove it (trainer/data/chat_check.py).

Where that does not answer for a conversation (its content is not in the rendered text, the
check fails), the conversation goes the per-conversation way of trainer/data/chat.py, which
tries the template's generation marks and exact token prefixes first, as it always did; so do
templates with `{% generation %}` marks and tokenizers without offsets (not fast ones).
For the templates whose turns end with eos (ChatML, Llama-3, the SentencePiece `[INST]` ones)
the masks are those of the per-conversation way bit for bit (tests/test_chat_batch.py). Where
eos is not what ends a turn (Gemma's `<end_of_turn>` with eos `<eos>`), the prefix way learned
the newline the template puts after the end marker; the offsets stop at the marker.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

from trainer.data.chat import (ChatError, chat_tokens, needed_turns, offset_spans,
                               supervised_mask)
from trainer.data.chat_check import Rendered, special_ids

Result = Union[tuple[list[int], list[bool]], Exception]


def _marked(tokenizer) -> bool:
    template = tokenizer.chat_template or ""
    return "{% generation %}" in template or "{%- generation %}" in template


def _fast(tokenizer) -> bool:
    return bool(getattr(tokenizer, "is_fast", False))


def _render_each(tokenizer, conversations: Sequence[list], prompt: bool) -> list:
    """The texts of the conversations, in one call; where the template refuses one, each
    alone (the refused ones are their exception)."""
    if all(conversations):
        try:
            return list(tokenizer.apply_chat_template(
                [list(c) for c in conversations], tokenize=False,
                add_generation_prompt=prompt))
        except Exception:  # one of them: find which, below
            pass
    texts: list = []
    for messages in conversations:
        try:
            texts.append(tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                       add_generation_prompt=prompt))
        except Exception as exc:  # the template raised on this one (jinja2, raise_exception)
            texts.append(exc)
    return texts


def _direct(tokenizer):
    """A render of one conversation straight from the compiled template, without transformers'
    per-call copying and checks of the messages (most of a render's time); None where that
    private helper is gone. Used only where it gives the same text as apply_chat_template."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        template = _compile_jinja_template(tokenizer.chat_template)
    except Exception:  # another transformers: every render goes through apply_chat_template
        return None
    specials = dict(tokenizer.special_tokens_map)

    def render(messages: list, prompt: bool) -> str:
        return template.render(messages=messages, tools=None, documents=None,
                               add_generation_prompt=prompt, **specials)
    return render


def _prompts(tokenizer, conversations: Sequence[list], texts: Sequence[str]) -> list[dict]:
    """Per conversation: message index of each assistant turn -> the render of the messages
    before it with the generation prompt (None where the template refuses it). Rendered
    directly where the direct render of the whole conversation is `texts`' (the library's),
    else by apply_chat_template, all such in one call."""
    direct = _direct(tokenizer)
    heads, where = [], []
    out: list[dict] = [{} for _ in conversations]
    for i, messages in enumerate(conversations):
        turns = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
        try:
            same = direct is not None and direct(list(messages), False) == texts[i]
        except Exception:  # the template refused: let apply_chat_template say the same
            same = False
        for k in turns:
            if same and k > 0:
                try:
                    out[i][k] = direct(list(messages[:k]), True)
                except Exception:  # a template may refuse a partial conversation
                    out[i][k] = None
            else:
                heads.append(messages[:k])
                where.append((i, k))
    for (i, k), text in zip(where, _render_each(tokenizer, heads, prompt=True)):
        out[i][k] = text if isinstance(text, str) else None
    return out


def chat_batch(tokenizer, conversations: Sequence[list], train_on: str,
               wheres: Sequence[str]) -> list[Result]:
    """Per conversation: (token ids, supervised per token), or the exception that refuses it
    (a ChatError naming it, or what its template raised)."""
    if not _fast(tokenizer) or (train_on != "all" and _marked(tokenizer)):
        return [_one(tokenizer, m, train_on, w) for m, w in zip(conversations, wheres)]
    texts = _render_each(tokenizer, conversations, prompt=False)
    good = [i for i, t in enumerate(texts) if isinstance(t, str)]
    encoded = tokenizer([texts[i] for i in good], add_special_tokens=False,
                        return_offsets_mapping=train_on != "all") if good else {}
    results: list[Result] = list(texts)
    if train_on == "all":
        for n, i in enumerate(good):
            ids = list(encoded["input_ids"][n])
            results[i] = (ids, [True] * len(ids))
        return results
    prompts = _prompts(tokenizer, [conversations[i] for i in good], [texts[i] for i in good])
    specials = special_ids(tokenizer)
    for n, i in enumerate(good):
        # (begin, end) pairs as the tokenizer gives them: only read by index and unpacking
        shown = Rendered(texts[i], list(encoded["input_ids"][n]),
                         list(encoded["offset_mapping"][n]), specials)
        results[i] = _from_offsets(tokenizer, conversations[i], shown, train_on, wheres[i],
                                   prompts[n])
    return results


def _from_offsets(tokenizer, messages: list, shown: Rendered, train_on: str, where: str,
                  prompts: dict) -> Result:
    needed = needed_turns(messages, train_on)
    if not needed:
        return shown.ids, [False] * len(shown.ids)
    try:
        spans = offset_spans(tokenizer, messages, shown, needed, where, prompts)
    except ChatError:  # the per-conversation way tries generation marks and prefixes first
        return _one(tokenizer, messages, train_on, where)
    return shown.ids, supervised_mask(len(shown.ids), spans, needed)


def _one(tokenizer, messages: list, train_on: str, where: str) -> Result:
    try:
        return chat_tokens(tokenizer, messages, train_on, where)
    except Exception as exc:  # ChatError, or the template's own: the caller names or skips it
        return exc


def first_error(results: Sequence[Result]) -> Optional[Exception]:
    return next((r for r in results if isinstance(r, Exception)), None)
