"""Assistant masks for chat templates in the shapes of real models' (issue 39): each turn's
supervised tokens decode to exactly its content and end marker, whichever way the mask was found
(generation marks, exact token prefixes, or the rendered text's character offsets)."""

from __future__ import annotations

import copy

import pytest

from trainer.data import chat
from trainer.data.chat import ChatError, chat_tokens
from trainer.data.chat_check import render
from trainer.data.demo import SHAPES, make_shaped_tokenizer

SYSTEM = {"role": "system", "content": "the lazy dog"}
TALK = [{"role": "user", "content": "quick brown fox"},
        {"role": "assistant", "content": "seven wizards"},
        {"role": "user", "content": "jovial zebras"},
        {"role": "assistant", "content": "packing boxes of liquor jugs"}]
# shape: (the turns' decoded spans, the way that found them). The system prompt goes in every
# conversation but Mistral's (whose template has no place for one); Llama-2 and Gemma fold it
# into the first user turn. SentencePiece decoders drop a first token's leading space.
EXPECTED = {
    "llama2": (["seven wizards </s>", "packing boxes of liquor jugs </s>"], "prefix"),
    # Its pieces merge `[/INST]` with the reply: the first token is learned whole.
    "mistral": (["[/INST]seven wizards</s>", "[/INST]packing boxes of liquor jugs</s>"],
                "offsets"),
    "llama3": (["seven wizards<|eot_id|>", "packing boxes of liquor jugs<|eot_id|>"], "prefix"),
    # eos is <eos>, not <end_of_turn>: the prefix way keeps the newline after it (as before).
    "gemma": (["seven wizards<end_of_turn>\n", "packing boxes of liquor jugs<end_of_turn>\n"],
              "prefix"),
    # The whole conversation ends with eos, so a prefix through a turn is no token prefix.
    "phi3": (["seven wizards<|end|>", "packing boxes of liquor jugs<|end|>"], "offsets"),
    "chatml": (["seven wizards<|im_end|>", "packing boxes of liquor jugs<|im_end|>"], "prefix"),
    "chatml_marked": (["seven wizards<|im_end|>\n", "packing boxes of liquor jugs<|im_end|>\n"],
                      "marks"),
}
# What the offsets way alone finds: content and end marker, through the first special token.
OFFSETS = {shape: [s.rstrip("\n") for s in spans] for shape, (spans, _) in EXPECTED.items()}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("shapes")
    return {shape: AutoTokenizer.from_pretrained(str(make_shaped_tokenizer(root / shape, shape)))
            for shape in SHAPES}


def conversation(shape: str) -> list[dict]:
    return TALK if shape == "mistral" else [SYSTEM] + TALK


def decoded_runs(tokenizer, ids, supervised) -> list[str]:
    """The supervised tokens, run by run, decoded (special tokens kept, spaces not cleaned)."""
    runs, run = [], []
    for token, learned in zip(ids + [None], supervised + [False]):
        if learned:
            run.append(token)
        elif run:
            runs.append(run)
            run = []
    return [tokenizer.decode(r, skip_special_tokens=False, clean_up_tokenization_spaces=False)
            for r in runs]


@pytest.mark.parametrize("shape", sorted(EXPECTED))
def test_each_turn_decodes_to_its_content_and_end_marker(tokenizers, shape) -> None:
    tokenizer, messages = tokenizers[shape], conversation(shape)
    spans, way = EXPECTED[shape]
    ids, supervised = chat_tokens(tokenizer, messages, "assistant")
    assert decoded_runs(tokenizer, ids, supervised) == spans
    ids, last = chat_tokens(tokenizer, messages, "last")
    assert decoded_runs(tokenizer, ids, last) == spans[-1:]
    assert ids == tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]
    # Which way found them: generation marks, else exact prefixes, else offsets.
    shown = render(tokenizer, messages)
    marked = chat._marked_spans(tokenizer, messages)
    prefixed = chat._prefix_spans(tokenizer, messages, shown.ids)
    assert way == ("marks" if marked else "prefix" if prefixed else "offsets")
    # The offsets way alone finds every turn in every shape.
    offsets = chat._offset_spans(tokenizer, messages, shown, {0, 1}, "a conversation")
    mask = [False] * len(shown.ids)
    for start, end in offsets:
        mask[start:end] = [True] * (end - start)
    assert decoded_runs(tokenizer, shown.ids, mask) == OFFSETS[shape]


def test_a_sentencepiece_template_refused_before_is_masked_now(tokenizers) -> None:
    """Mistral's `[/INST]` joined to the reply: the exact-prefix way fails (the old refusal),
    and no prompt token but the merged first one is learned."""
    tokenizer = tokenizers["mistral"]
    assert chat._prefix_spans(tokenizer, TALK, render(tokenizer, TALK).ids) is None
    ids, supervised = chat_tokens(tokenizer, TALK, "assistant")
    ignored = tokenizer.decode([i for i, s in zip(ids, supervised) if not s],
                               skip_special_tokens=False)
    assert "quick brown fox" in ignored and "jovial zebras" in ignored
    assert "seven" not in ignored and "packing" not in ignored


def test_a_reply_the_user_quoted_is_found_in_its_own_turn(tokenizers) -> None:
    tokenizer = tokenizers["phi3"]  # the offsets way
    messages = [{"role": "user", "content": "say seven wizards"},
                {"role": "assistant", "content": "seven wizards"},
                {"role": "user", "content": "seven wizards"},
                {"role": "assistant", "content": "seven wizards"}]
    ids, supervised = chat_tokens(tokenizer, messages, "assistant")
    assert decoded_runs(tokenizer, ids, supervised) == ["seven wizards<|end|>"] * 2
    first = supervised.index(True)
    assert tokenizer.decode(ids[:first]).endswith("<|assistant|>\n")


def test_a_reply_the_template_changes_is_refused_naming_the_record(tmp_path) -> None:
    from transformers import AutoTokenizer

    shouting = SHAPES["phi3"][0].replace("m['content']", "m['content'] | upper")
    folder = make_shaped_tokenizer(tmp_path / "t", "phi3")
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    tokenizer.chat_template = shouting
    with pytest.raises(ChatError, match=r"data.tokenizer: .* assistant turn 1 of c.jsonl record "
                                        r"3 \('seven wizards'\) .*data.train_on=all"):
        chat_tokens(tokenizer, TALK, "assistant", where="c.jsonl record 3")
    assert all(chat_tokens(tokenizer, TALK, "all")[1])  # train_on=all needs no spans


def test_a_template_that_rewrites_earlier_turns_is_read_from_offsets(tmp_path) -> None:
    """Numbering turns from the end: no prefix of the conversation templates as the whole does
    (refused before), but every content is in the text."""
    from transformers import AutoTokenizer

    template = ("{% for m in messages %}<|im_start|>{{ messages|length - loop.index }} "
                "{{ m['content'] }}<|im_end|>{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>{% endif %}")
    tokenizer = AutoTokenizer.from_pretrained(
        str(make_shaped_tokenizer(tmp_path / "t", "chatml")))
    tokenizer.chat_template = template
    assert chat._prefix_spans(tokenizer, TALK, render(tokenizer, TALK).ids) is None
    ids, supervised = chat_tokens(tokenizer, TALK, "assistant")
    # The template's space before a reply is in the reply's first byte-level token (" seven").
    assert decoded_runs(tokenizer, ids, supervised) == [
        " seven wizards<|im_end|>", " packing boxes of liquor jugs<|im_end|>"]


def test_generation_marks_that_fail_the_check_are_not_used(tmp_path) -> None:
    """A generation block around the header too: its mask would teach the prompt's tokens."""
    from transformers import AutoTokenizer

    template = SHAPES["chatml_marked"][0].replace(
        "<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}{% generation %}",
        "{% if m['role'] == 'assistant' %}{% generation %}<|im_start|>{{ m['role'] }}\n"
    ).replace("{% else %}{{ m['content'] }}", "{% else %}<|im_start|>{{ m['role'] }}\n"
                                              "{{ m['content'] }}")
    tokenizer = AutoTokenizer.from_pretrained(
        str(make_shaped_tokenizer(tmp_path / "t", "chatml_marked")))
    tokenizer.chat_template = template
    ids, marked = chat._marked_spans(tokenizer, TALK)
    assert tokenizer.decode(ids[marked[0][0]:marked[0][1]]).startswith("<|im_start|>assistant")
    ids, supervised = chat_tokens(tokenizer, TALK, "assistant")
    assert decoded_runs(tokenizer, ids, supervised) == [
        "seven wizards<|im_end|>", "packing boxes of liquor jugs<|im_end|>"]


def test_an_empty_reply_learns_its_end_marker(tokenizers) -> None:
    tokenizer = tokenizers["phi3"]
    messages = [{"role": "user", "content": "fox"}, {"role": "assistant", "content": ""},
                {"role": "user", "content": "dog"}, {"role": "assistant", "content": "seven"}]
    ids, supervised = chat_tokens(tokenizer, messages, "assistant")
    assert decoded_runs(tokenizer, ids, supervised) == ["<|end|>", "seven<|end|>"]


@pytest.mark.parametrize("shape, learned", [
    ("llama3", "seven wizards<|eot_id|>"),  # trims contents; the prefix way
    # renders them as they are; the offsets way (a SentencePiece decode drops one first space)
    ("phi3", " seven wizards\n<|end|>"),
])
def test_a_reply_with_spaces_around_is_found_as_rendered(tokenizers, shape, learned) -> None:
    tokenizer = tokenizers[shape]
    messages = [{"role": "user", "content": "fox"},
                {"role": "assistant", "content": "  seven wizards\n"}]
    ids, supervised = chat_tokens(tokenizer, messages, "assistant")
    assert decoded_runs(tokenizer, ids, supervised) == [learned]


def test_text_the_tokenizer_normalises_is_compared_normalised(tmp_path) -> None:
    """An NFC normalizer (as Qwen2's) decodes a decomposed é composed: still the turn's text."""
    from tokenizers import normalizers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        str(make_shaped_tokenizer(tmp_path / "t", "chatml")))
    tokenizer.backend_tokenizer.normalizer = normalizers.NFC()
    messages = [{"role": "user", "content": "fox"},
                {"role": "assistant", "content": "cafe\u0301 wizards"}]
    ids, supervised = chat_tokens(tokenizer, messages, "assistant")
    assert decoded_runs(tokenizer, ids, supervised) == ["caf\u00e9 wizards<|im_end|>"]


def test_a_tokenizer_without_offsets_keeps_the_ways_it_had(tokenizers) -> None:
    """A Python tokenizer (no character offsets): marks and prefixes, unchecked, as before; a
    template neither holds for is refused in one line."""
    def without_offsets(tokenizer):
        fast = type(tokenizer)

        def call(self, *args, return_offsets_mapping=False, **kwargs):
            if return_offsets_mapping:
                raise NotImplementedError("a Python tokenizer")
            return fast.__call__(self, *args, **kwargs)
        tokenizer.__class__ = type("Python", (fast,), {"__call__": call})
        return tokenizer

    llama3 = without_offsets(copy.deepcopy(tokenizers["llama3"]))
    assert render(llama3, TALK).offsets is None
    ids, supervised = chat_tokens(llama3, TALK, "assistant")
    assert decoded_runs(llama3, ids, supervised) == EXPECTED["llama3"][0]
    with pytest.raises(ChatError, match="data.tokenizer: .* no fast tokenizer"):
        chat_tokens(without_offsets(copy.deepcopy(tokenizers["mistral"])), TALK, "assistant")
