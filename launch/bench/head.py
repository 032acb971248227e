"""`python -m launch.bench.head`: the chunked head (checkpointing/head.py) against
F.cross_entropy(F.linear(...)) on CPU: median forward+backward time and peak live tensor bytes.

`--supervised 0.4` makes a chat-like batch (that share of the targets learned, the rest ignored)
and times each head twice: on every row, and on the supervised rows only
(checkpointing.head_rows=supervised: `supervised_rows`, then `summed_head_loss`)."""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from typing import Optional

import torch
import torch.nn.functional as F

from checkpointing.head import chunked_linear_cross_entropy, summed_head_loss, supervised_rows
from checkpointing.plan import default_chunk_tokens
from checkpointing.planner.metatrace import LiveBytes


def plain_head(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Today's head, as the models compute it: full logits, upcast, cross-entropy."""
    return F.cross_entropy(F.linear(hidden, weight).float(), targets)


class _Output:
    """The output layer of `weight`, as summed_head_loss calls it."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)


def summed_head(chunk: Optional[int], gather: bool):
    """The models' summed head (as checkpointing.head_rows=supervised|all runs it): plain
    (chunk None) or chunked, on the supervised rows (gather, their selection timed too) or all."""
    def loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
        rows = supervised_rows(targets) if gather else None
        return summed_head_loss(lambda x: x, _Output(weight), hidden, targets, chunk, rows)
    return loss


def _step(loss_fn, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> float:
    """Seconds of one forward+backward with fresh leaves (no gradient accumulation)."""
    hidden = hidden.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    start = time.perf_counter()
    loss_fn(hidden, weight, targets).backward()
    return time.perf_counter() - start


def _peak_bytes(loss_fn, hidden: torch.Tensor, weight: torch.Tensor,
                targets: torch.Tensor) -> int:
    """Peak of the live tensor bytes one forward+backward creates (the gradients included, the
    inputs not)."""
    with LiveBytes() as live:  # it sees inside the head (SeeInsideHead)
        _step(loss_fn, hidden, weight, targets)
    return live.peak


def bench_vocab(tokens: int, vocab: int, dim: int, chunk: int, repeats: int,
                dtype: torch.dtype) -> dict:
    """Median step time and peak live bytes of the chunked and the plain head at one vocab."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, dim, generator=gen).to(dtype)
    weight = (torch.randn(vocab, dim, generator=gen) * dim ** -0.5).to(dtype)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    heads = {"chunked": lambda h, w, y: chunked_linear_cross_entropy(h, w, y, chunk),
             "plain": plain_head}
    times: dict[str, list[float]] = {name: [] for name in heads}
    for name, fn in heads.items():  # a warm-up step each, not counted
        _step(fn, hidden, weight, targets)
    for _ in range(repeats):  # interleaved, so that a slow moment of the machine hits both
        for name, fn in heads.items():
            times[name].append(_step(fn, hidden, weight, targets))
    row = {"vocab": vocab, "chunk": chunk}
    for name, fn in heads.items():
        row[f"{name}_s"] = statistics.median(times[name])
        row[f"{name}_peak"] = _peak_bytes(fn, hidden, weight, targets)
    return row


def bench_rows(tokens: int, vocab: int, dim: int, chunk: int, repeats: int,
               dtype: torch.dtype, supervised: float) -> list[dict]:
    """Per head (plain, chunked): median step time and peak live bytes on all rows and on the
    supervised rows only, for a batch with `supervised` of its targets learned."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, dim, generator=gen).to(dtype)
    weight = (torch.randn(vocab, dim, generator=gen) * dim ** -0.5).to(dtype)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    targets[torch.rand(tokens, generator=gen) >= supervised] = -100
    heads = {(head, rows): summed_head(chunk if head == "chunked" else None, rows == "supervised")
             for head in ("plain", "chunked") for rows in ("all", "supervised")}
    times: dict = {key: [] for key in heads}
    for fn in heads.values():  # a warm-up step each, not counted
        _step(fn, hidden, weight, targets)
    for _ in range(repeats):  # interleaved, so that a slow moment of the machine hits all
        for key, fn in heads.items():
            times[key].append(_step(fn, hidden, weight, targets))
    learned = int((targets != -100).sum())
    return [{"head": head, "rows": rows, "vocab": vocab, "learned": learned,
             "s": statistics.median(times[head, rows]),
             "peak": _peak_bytes(heads[head, rows], hidden, weight, targets)}
            for head, rows in heads]


def _print_rows(rows: list[dict], tokens: int) -> None:
    print(f"{'head':<8} {'rows':<11} {'vocab':>7} {'rows run':>9} {'s':>8} {'ratio':>6} "
          f"{'peak MiB':>9} {'ratio':>6}")
    for row in rows:
        base = next(r for r in rows if r["head"] == row["head"] and r["rows"] == "all"
                    and r["vocab"] == row["vocab"])
        run = tokens if row["rows"] == "all" else row["learned"]
        print(f"{row['head']:<8} {row['rows']:<11} {row['vocab']:>7} {run:>9} {row['s']:>8.3f} "
              f"{row['s'] / base['s']:>6.2f} {row['peak'] * 2.0 ** -20:>9.1f} "
              f"{row['peak'] / base['peak']:>6.3f}")


def main(argv: Optional[list[str]] = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m launch.bench.head", description=(
        "Forward+backward of the chunked fused head against F.cross_entropy(F.linear(...)) on "
        "CPU: median step time and peak live tensor bytes."))
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", default="32000,128256", help="comma-separated")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=0,
                        help="tokens per chunk (default: default_chunk_tokens(vocab))")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--supervised", type=float, default=None,
                        help="share of learned targets: each head on all rows and on those only")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    print(f"{datetime.date.today()}  torch {torch.__version__}  {torch.get_num_threads()} "
          f"threads  tokens {args.tokens}  dim {args.dim}  {args.dtype}  median of "
          f"{args.repeats} (after a warm-up)"
          + ("" if args.supervised is None else f"  {args.supervised:.0%} supervised"))
    if args.supervised is not None:
        rows = [row for vocab in (int(v) for v in args.vocab.split(","))
                for row in bench_rows(args.tokens, vocab, args.dim,
                                      args.chunk or default_chunk_tokens(vocab), args.repeats,
                                      dtype, args.supervised)]
        _print_rows(rows, args.tokens)
        return rows
    print(f"{'vocab':>7} {'chunk':>6} {'chunked s':>10} {'plain s':>8} {'ratio':>6} "
          f"{'chunked peak MiB':>17} {'plain peak MiB':>15} {'ratio':>6}")
    rows = []
    for vocab in (int(v) for v in args.vocab.split(",")):
        chunk = args.chunk or default_chunk_tokens(vocab)
        row = bench_vocab(args.tokens, vocab, args.dim, chunk, args.repeats, dtype)
        rows.append(row)
        mib = 2.0 ** -20
        print(f"{vocab:>7} {chunk:>6} {row['chunked_s']:>10.3f} {row['plain_s']:>8.3f} "
              f"{row['chunked_s'] / row['plain_s']:>6.2f} {row['chunked_peak'] * mib:>17.1f} "
              f"{row['plain_peak'] * mib:>15.1f} "
              f"{row['chunked_peak'] / row['plain_peak']:>6.3f}")
    return rows


if __name__ == "__main__":
    main()
