"""Generated conversations of a real chat set's length, for launch/bench/data_prep.py.

trainer/data/demo.py's records are short on purpose (tests): 1-3 turns of at most 20 words of a
25-word vocabulary. What a preparation costs per token depends on the shape of real data:
several turns, replies of a few hundred words, a vocabulary the tokenizer splits (rare words in
pieces), punctuation, lists, numbers and code. These are generated to match the public set the
issue measured (4,018 conversations, 3.6M tokens with a 32,000-id tokenizer: ~900 tokens a
conversation): 1 to 8 exchanges (most 1-3), questions of 5-80 words, replies of 30-400, words
drawn from a Zipf-distributed vocabulary of 20,000 made-up words, so a tokenizer learned on
them keeps the frequent ones whole and splits the rest, as real vocabularies do with English.
"""

from __future__ import annotations

import random
from typing import Iterator

SYLLABLES = ("ka ne ri to sa mu le po vi da ge lo bi tu ra me si no pa ke ru ho fa zi "
             "an en in on un ar er or str th ch sh pl gr tr bl ck ng st").split()
VOCABULARY = 20_000


def _words() -> list[str]:
    """The made-up vocabulary (one for every seed): short words for the frequent ranks,
    longer ones for the rare."""
    rng = random.Random(0)
    seen: set[str] = set()
    out = []
    while len(out) < VOCABULARY:
        parts = 1 + min(4, int(rng.expovariate(1.0) + len(out) / 4000))
        word = "".join(rng.choice(SYLLABLES) for _ in range(parts))
        if word not in seen:
            seen.add(word)
            out.append(word)
    return out


class Talker:
    """Sentences, paragraphs, lists and code in a Zipf-distributed made-up language."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.vocab = _words()
        weights = [1.0 / (rank + 1) for rank in range(VOCABULARY)]
        total = sum(weights)
        self.cumulative, acc = [], 0.0
        for w in weights:
            acc += w / total
            self.cumulative.append(acc)

    def word(self) -> str:
        import bisect

        at = bisect.bisect_left(self.cumulative, self.rng.random())
        return self.vocab[min(at, VOCABULARY - 1)]

    def sentence(self, n: int) -> str:
        words = [self.word() for _ in range(max(1, n))]
        if self.rng.random() < 0.15:
            words.insert(self.rng.randrange(len(words)), str(self.rng.randint(0, 2030)))
        if len(words) > 6 and self.rng.random() < 0.4:
            words[self.rng.randrange(1, len(words) - 1)] += ","
        text = " ".join(words)
        return text[0].upper() + text[1:] + self.rng.choice(".....?!:")

    def text(self, words: int) -> str:
        """About `words` words: paragraphs of sentences, now and then a list or a code block."""
        out, left = [], words
        while left > 0:
            shape = self.rng.random()
            if shape < 0.08 and left > 20:
                items = [f"{i + 1}. {self.sentence(self.rng.randint(3, 12))}"
                         for i in range(self.rng.randint(2, 5))]
                out.append("\n".join(items))
                left -= sum(len(i.split()) for i in items)
            elif shape < 0.12 and left > 20:
                lines = [f"    {self.word()}_{self.word()} = {self.word()}({self.rng.randint(0, 99)})"
                         for _ in range(self.rng.randint(2, 6))]
                out.append("```\n" + "\n".join(lines) + "\n```")
                left -= 3 * len(lines)
            else:
                paragraph = [self.sentence(self.rng.randint(4, 24))
                             for _ in range(self.rng.randint(1, 5))]
                out.append(" ".join(paragraph))
                left -= sum(len(s.split()) for s in paragraph)
        return "\n\n".join(out)


def conversations(n: int, seed: int = 1, system: bool = True) -> list[dict]:
    """`n` records {"id", "messages"}: a system prompt (unless not `system`), then 1-8
    user/assistant exchanges."""
    talk = Talker(seed)
    rng = talk.rng
    records = []
    for i in range(n):
        turns = ([{"role": "system", "content": talk.sentence(rng.randint(5, 30))}]
                 if system else [])
        for _ in range(min(8, 1 + int(rng.expovariate(0.6)))):
            turns.append({"role": "user", "content": talk.text(rng.randint(5, 80))})
            turns.append({"role": "assistant",
                          "content": talk.text(int(rng.lognormvariate(4.9, 0.6)))})
        records.append({"id": i, "messages": turns})
    return records


def documents(n: int, seed: int = 2) -> list[dict]:
    """`n` text records {"id", "text"} of 50-1,500 words (web pages' spread)."""
    talk = Talker(seed)
    return [{"id": i, "text": talk.text(int(talk.rng.lognormvariate(5.5, 0.8)) + 50)}
            for i in range(n)]


def corpus(records: list[dict]) -> Iterator[str]:
    """The texts of `records` (either kind), for learning a tokenizer's pieces."""
    for record in records:
        if "text" in record:
            yield record["text"]
        else:
            yield from (m["content"] for m in record["messages"])
