"""The record shapes chat data comes in, read as one conversation of {role, content} turns.

- `messages`: `data.messages_field` holds the turns, `{role, content}` each (or ShareGPT's
  `{from, value}`).
- `sharegpt`: `conversations` holds `{from, value}` turns; `from` is human, gpt or system (user
  and assistant are read too).
- `alpaca`: `instruction` (with `input`, when there is one, after a blank line) is the user's
  turn and `output` the assistant's.
- `prompt_completion`: `data.prompt_field` is the user's turn, `data.completion_field` the
  assistant's.

`data.format=auto` reads each record in the first of these shapes whose fields it has (a file
may mix them); any other value reads that one shape only. A record in none of them is refused
in one line naming it, the fields it has and the shapes accepted.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

FORMATS = ("auto", "messages", "sharegpt", "alpaca", "prompt_completion")
SHAREGPT_FIELD = "conversations"
ALPACA_FIELDS = ("instruction", "input", "output")
# ShareGPT's speakers as chat-template roles.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system"}


class FormatError(ValueError):
    """A record that is in none of the accepted shapes; the message names the setting."""


def required_fields(messages_field: str, prompt_field: str,
                    completion_field: str) -> dict[str, tuple[str, ...]]:
    """The fields each shape needs, in the order `auto` tries them."""
    return {"messages": (messages_field,), "sharegpt": (SHAREGPT_FIELD,),
            "alpaca": (ALPACA_FIELDS[0], ALPACA_FIELDS[2]),
            "prompt_completion": (prompt_field, completion_field)}


def accepted(fmt: str, needs: dict[str, tuple[str, ...]]) -> str:
    """The shapes `fmt` accepts, each with its fields, for an error line."""
    names = [name for name in needs if fmt in ("auto", name)]
    return "; ".join(f"{name}: {' + '.join(repr(f) for f in needs[name])}" for name in names)


def check_field_names(names: Sequence[str], fmt: str, messages_field: str, prompt_field: str,
                      completion_field: str, path: str) -> None:
    """One line when records with these fields (a file's first record or its columns) are in
    none of the shapes `fmt` accepts."""
    needs = required_fields(messages_field, prompt_field, completion_field)
    if any(fmt in ("auto", name) and all(f in names for f in fields)
           for name, fields in needs.items()):
        return
    raise FormatError(f"data.format: {path} is not chat data of data.format={fmt} (fields "
                      f"wanted: {accepted(fmt, needs)}); its fields: {', '.join(names)}")


def conversation(record: Mapping[str, Any], fmt: str, messages_field: str, prompt_field: str,
                 completion_field: str, where: str) -> list[dict]:
    """The turns of one record, [{role, content}, ...]; `where` names the record in errors."""
    needs = required_fields(messages_field, prompt_field, completion_field)
    for name, fields in needs.items():
        if fmt in ("auto", name) and all(record.get(f) is not None for f in fields):
            turns = _read(name, record, fields, where)
            bad = next((k for k, t in enumerate(turns) if not isinstance(t["content"], str)),
                       None)
            if bad is not None:
                raise FormatError(f"data.format: {where}: turn {bad + 1}'s content is not "
                                  f"text but {type(turns[bad]['content']).__name__}")
            return turns
    found = [k for k, v in record.items() if v is not None]
    raise FormatError(f"data.format: {where} is not chat data of data.format={fmt} (fields "
                      f"wanted: {accepted(fmt, needs)}); its fields: {', '.join(found)}")


def _read(name: str, record: Mapping[str, Any], fields: tuple[str, ...], where: str) -> list:
    if name in ("messages", "sharegpt"):
        return _turns(record[fields[0]], fields[0], where)
    if name == "alpaca":
        extra = record.get(ALPACA_FIELDS[1])
        prompt = record[fields[0]]
        if isinstance(extra, str) and extra.strip():
            prompt = f"{prompt}\n\n{extra}"
        return [{"role": "user", "content": prompt},
                {"role": "assistant", "content": record[fields[1]]}]
    return [{"role": "user", "content": record[fields[0]]},
            {"role": "assistant", "content": record[fields[1]]}]


def _turns(turns: Any, field: str, where: str) -> list[dict]:
    """{role, content} turns as they are; ShareGPT's {from, value} with roles mapped."""
    if not isinstance(turns, list):
        raise FormatError(f"data.format: {where}: {field!r} is not a list of turns but "
                          f"{type(turns).__name__}")
    out = []
    for k, turn in enumerate(turns):
        out.append(_turn(turn, k, field, where))
    return out


def _turn(turn: Any, k: int, field: str, where: str) -> dict:
    if isinstance(turn, Mapping) and "role" in turn and "content" in turn:
        return {"role": turn["role"], "content": turn["content"]}
    if isinstance(turn, Mapping) and "from" in turn and "value" in turn:
        role = SHAREGPT_ROLES.get(turn["from"])
        if role is None:
            raise FormatError(f"data.format: {where}: turn {k + 1} is from {turn['from']!r}; "
                              f"ShareGPT turns are from {', '.join(SHAREGPT_ROLES)}")
        return {"role": role, "content": turn["value"]}
    keys = ", ".join(turn) if isinstance(turn, Mapping) else type(turn).__name__
    raise FormatError(f"data.format: {where}: turn {k + 1} of {field!r} is not a {{role, "
                      f"content}} or {{from, value}} turn ({keys})")


def record_name(path: str, index: Optional[int], record: Mapping[str, Any]) -> str:
    """How an error names a record: its file (or data.path) and index, and its id if it has one."""
    name = f"{path} record {index}" if index is not None else f"a record of {path}"
    ident = record.get("id")
    return f"{name} (id {ident!r})" if ident is not None else name
