"""The record shapes data=chat reads (issue 39): messages, ShareGPT, Alpaca, prompt/completion,
detected per record or named with data.format; anything else one line naming the record, its
fields and the shapes accepted."""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers import config
from trainer.config import CHOICES, ConfigError
from trainer.data.demo import chat_records, make_tokenizer, write_jsonl
from trainer.data.documents import text_datasets
from trainer.data.formats import FORMATS, FormatError, conversation
from trainer.data.sources import DataError, DocSettings
from trainer.preflight.precheck import deep_check

FIELDS = ("messages", "prompt", "completion")
TURNS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "fox"},
         {"role": "assistant", "content": "dog"}]
SHAPED = {
    "messages": {"messages": TURNS},
    "sharegpt": {"conversations": [{"from": "system", "value": "be brief"},
                                   {"from": "human", "value": "fox"},
                                   {"from": "gpt", "value": "dog"}]},
    "alpaca": {"instruction": "fox", "input": "", "output": "dog"},
    "prompt_completion": {"prompt": "fox", "completion": "dog"},
}


def read(record: dict, fmt: str = "auto") -> list[dict]:
    return conversation(record, fmt, *FIELDS, where="r.jsonl record 0")


@pytest.mark.parametrize("shape", sorted(SHAPED))
def test_each_shape_is_read_as_turns_detected_or_named(shape) -> None:
    want = TURNS if shape in ("messages", "sharegpt") else TURNS[1:]
    assert read(SHAPED[shape]) == want
    assert read(SHAPED[shape], shape) == want
    other = next(f for f in FORMATS[1:] if f != shape)
    with pytest.raises(FormatError, match=f"data.format: r.jsonl record 0 is not chat data of "
                                          f"data.format={other} .*; its fields: "):
        read(SHAPED[shape], other)


def test_alpaca_input_follows_the_instruction() -> None:
    turns = read({"instruction": "name the animal", "input": "a quick fox", "output": "fox"})
    assert turns == [{"role": "user", "content": "name the animal\n\na quick fox"},
                     {"role": "assistant", "content": "fox"}]


@pytest.mark.parametrize("record, says", [
    ({"conversation": [], "id": 7}, r"data.format: r.jsonl record 0 is not chat data of "
     r"data.format=auto \(fields wanted: messages: 'messages'; sharegpt: 'conversations'; "
     r"alpaca: 'instruction' \+ 'output'; prompt_completion: 'prompt' \+ 'completion'\); "
     r"its fields: conversation, id"),
    ({"conversations": [{"from": "bing", "value": "x"}]}, r"turn 1 is from 'bing'; ShareGPT "
     r"turns are from human, user, gpt, assistant, system"),
    ({"messages": [{"speaker": "x"}]}, r"turn 1 of 'messages' is not a \{role, content\} or "
     r"\{from, value\} turn \(speaker\)"),
    ({"messages": "fox"}, r"'messages' is not a list of turns but str"),
    ({"prompt": "fox", "completion": 3}, r"turn 2's content is not text but int"),
])
def test_a_record_in_no_shape_is_one_line(record, says) -> None:
    with pytest.raises(FormatError, match=says):
        read(record)


def test_the_format_choices_are_the_config_choices() -> None:
    assert CHOICES["data.format"] == FORMATS


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return str(make_tokenizer(tmp_path_factory.mktemp("tok") / "chatml"))


def test_a_file_of_mixed_shapes_trains_and_the_format_is_in_the_cache_key(tmp_path, tok) -> None:
    records = chat_records(30)
    for i, record in enumerate(records[:20]):
        user, reply = record["messages"][1]["content"], record["messages"][2]["content"]
        records[i] = [{"conversations": [{"from": "human", "value": user},
                                         {"from": "gpt", "value": reply}]},
                      {"instruction": user, "output": reply},
                      {"prompt": user, "completion": reply}][i % 3]
    path = write_jsonl(tmp_path / "mixed.jsonl", records)
    train, _ = text_datasets(str(path), None, tok, DocSettings("chat", 96), str(tmp_path), 10_000,
                             preparer=True)
    meta = json.load(open(os.path.join(os.path.dirname(train.folder), "meta.json")))
    assert meta["documents"] == 30 and meta["skipped"] == 0
    # Another format is another cache folder: tokenized again (not the cached windows), so the
    # first record that is not ShareGPT is named.
    with pytest.raises(DataError, match=r"data.format: .*mixed.jsonl record 1 is not chat data "
                                        r"of data.format=sharegpt"):
        text_datasets(str(path), None, tok, DocSettings("chat", 96, format="sharegpt"),
                      str(tmp_path), 10_000, preparer=True)


def test_the_record_a_template_cannot_mask_is_named(tmp_path) -> None:
    shouting = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | upper }}"
                "<|im_end|>\n{% endfor %}")
    folder = make_tokenizer(tmp_path / "t", template=shouting)
    records = chat_records(5)
    path = write_jsonl(tmp_path / "c.jsonl", records)
    with pytest.raises(DataError, match=r"data.tokenizer: .* assistant turn 1 of .*c.jsonl "
                                        r"record 0 \(id 0\) .*set data.train_on=all"):
        text_datasets(str(path), None, str(folder), DocSettings("chat", 96), str(tmp_path),
                      10_000, preparer=True)


def test_a_named_format_the_file_lacks_is_one_line_before_start(tmp_path, tok) -> None:
    path = write_jsonl(tmp_path / "c.jsonl", chat_records(3))
    cfg = config("data=chat", f"data.path={path}", f"data.tokenizer={tok}", "data.format=alpaca")
    with pytest.raises(ConfigError, match=r"data.format: .*c.jsonl is not chat data of "
                                          r"data.format=alpaca \(fields wanted: alpaca: "
                                          r"'instruction' \+ 'output'\); its fields: id, messages"):
        deep_check(cfg)
    deep_check(config("data=chat", f"data.path={path}", f"data.tokenizer={tok}",
                      "data.format=messages", "model.vocab_size=512"))
