"""Next tokens, greedy or sampled, and their text as it grows.

Each new token runs the model on the whole sequence so far: no KV cache (the built-in Llama has
none; HF models are called the same way, so both give the same tokens as a full forward would).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy (the most likely token)
    top_k: int = 0  # 0: all tokens
    top_p: float = 1.0  # 1: all tokens
    seed: int = 0


def choose(logits: torch.Tensor, sampling: Sampling,
           generator: Optional[torch.Generator]) -> int:
    """One token id from the last position's logits [vocab]."""
    if sampling.temperature <= 0:
        return int(torch.argmax(logits))
    scores = logits.float() / sampling.temperature
    if 0 < sampling.top_k < scores.numel():
        kth = torch.topk(scores, sampling.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
        # drop a token once the ones before it already hold top_p (the first always stays)
        drop = cumulative - torch.softmax(ordered, dim=-1) >= sampling.top_p
        scores = scores.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


class TextStream:
    """The text of the ids so far, handed out piece by piece: a piece waits while its last
    bytes are an unfinished UTF-8 character (decoded as U+FFFD)."""

    def __init__(self, tokenizer, write: Callable[[str], None]) -> None:
        self.tokenizer, self.write = tokenizer, write
        self.ids: list[int] = []
        self.shown = ""

    def push(self, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(self.shown):
            return
        self.write(text[len(self.shown):])
        self.shown = text

    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)


@torch.no_grad()
def generate(logits_of: Callable[[torch.Tensor], torch.Tensor], prompt: list[int],
             max_new_tokens: int, sampling: Sampling, stop: set[int], device: torch.device,
             limit: Optional[int] = None,
             on_token: Callable[[int], None] = lambda token: None) -> list[int]:
    """The new ids after `prompt` (an id in `stop` ends it, and is not returned), at most
    `max_new_tokens` and no more than `limit` in all."""
    generator = None
    if sampling.temperature > 0:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    new: list[int] = []
    while len(new) < max_new_tokens and (limit is None or ids.shape[1] < limit):
        token = choose(logits_of(ids)[0, -1], sampling, generator)
        if token in stop:
            break
        new.append(token)
        on_token(token)
        ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
    return new
