"""`python -m trainer.generate RUN_OR_CHECKPOINT (--prompt TEXT | --chat [--message TEXT ...])`.

    python -m trainer.generate outputs/quickstart --prompt "def main("
    python -m trainer.generate outputs/my-run --chat                    # type turns; Ctrl-D ends
    python -m trainer.generate outputs/my-run --chat --message "hi" --message "and then?"
    python -m trainer.generate outputs/my-run --prompt "Once" --temperature 0.8 --top-p 0.9

Greedy by default (--temperature 0); --temperature, --top-k, --top-p and --seed sample. The
text is written to the terminal token by token. A mistake (a folder that holds no model, a
prompt longer than the model reads, --chat with a tokenizer without a chat template) is one line
and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional

USAGE_ERROR = 2


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.generate",
                                description=__doc__.split("\n\n")[0].strip("`"),
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("run", metavar="RUN_OR_CHECKPOINT",
                   help="a run directory (its newest committed checkpoint), a "
                        "checkpoints/step_<N> folder, or a `python -m trainer.export` folder")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="text the model continues (no chat template)")
    what.add_argument("--chat", action="store_true",
                      help="a conversation through the run's chat template: turns from --message "
                           "(in order), else typed ones")
    p.add_argument("--message", action="append", default=[],
                   help="with --chat: a user turn; repeat for a scripted chat")
    p.add_argument("--system", help="with --chat: a system turn first")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest (0: all)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the likeliest tokens holding this probability (1: all)")
    p.add_argument("--seed", type=int, default=0, help="the sampler's seed")
    p.add_argument("--device", default="auto", help="auto (CUDA when there is one), cpu, cuda:N")
    p.add_argument("--tokenizer", help="a tokenizer folder instead of the run's own")
    return p


def _check(args: argparse.Namespace) -> None:
    from trainer.generate.load import GenerateError

    if args.message and not args.chat:
        raise GenerateError("--message goes with --chat (for plain text use --prompt)")
    if args.max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens: must be at least 1, got {args.max_new_tokens}")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        raise GenerateError("--temperature must be >= 0, --top-p in (0, 1], --top-k >= 0")


def main(argv: Optional[list[str]] = None) -> int:
    args = parser().parse_args(argv)
    from trainer.generate.load import GenerateError

    try:
        _check(args)
        return _run(args)
    except GenerateError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print("", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    from trainer.generate.decode import Sampling
    from trainer.generate.load import load, pick_device

    loaded = load(args.run, pick_device(args.device), args.tokenizer)
    tok = loaded.tokenizer
    stop = set(loaded.eos_ids) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    say = _speaker(loaded, args.max_new_tokens, sampling, stop)
    if args.prompt is not None:
        say(tok(args.prompt, add_special_tokens=False)["input_ids"], "--prompt", args.prompt)
        write("\n")
        return 0
    _chat(loaded, args, say)
    return 0


def write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _speaker(loaded, max_new_tokens: int, sampling, stop: set[int]) -> Callable:
    """say(prompt ids, what they came from, text to show first) -> the reply's text, streamed
    as it comes. The first call also names the folder and device (on stderr)."""
    from trainer.generate.decode import TextStream, generate
    from trainer.generate.load import GenerateError

    said = []

    def say(ids: list[int], source: str, before: str = "") -> str:
        if loaded.limit is not None and len(ids) >= loaded.limit:
            raise GenerateError(f"{source}: {len(ids)} tokens; the model reads at most "
                                f"{loaded.limit} (max_seq_len) and needs room for one more")
        if not said:
            print(f"[{loaded.what} on {loaded.device}]", file=sys.stderr, flush=True)
            said.append(True)
        write(before)
        stream = TextStream(loaded.tokenizer, write)
        new = generate(loaded.logits, ids, max_new_tokens, sampling, stop, loaded.device,
                       loaded.limit, stream.push)
        if loaded.limit is not None and len(ids) + len(new) >= loaded.limit:
            print(f"\n[stopped at the model's max_seq_len={loaded.limit}]", file=sys.stderr)
        return stream.text()

    return say


def _chat(loaded, args: argparse.Namespace, say: Callable) -> None:
    from trainer.generate.load import GenerateError

    tok = loaded.tokenizer
    if not getattr(tok, "chat_template", None):
        raise GenerateError(f"--chat: the run's tokenizer ({tok.name_or_path or 'bytes'}) has "
                            "no chat template; use --prompt, or --tokenizer with one that has")
    messages = [{"role": "system", "content": args.system}] if args.system else []
    turns = iter(args.message) if args.message else _typed()
    for turn in turns:
        if args.message:
            write(f"user: {turn}\n")
        messages.append({"role": "user", "content": turn})
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        reply = say(tok(text, add_special_tokens=False)["input_ids"], "--chat", "assistant: ")
        write("\n")
        messages.append({"role": "assistant", "content": reply})


def _typed():
    """User turns typed at the terminal, until an empty line or Ctrl-D."""
    while True:
        try:
            line = input("user: ")
        except EOFError:
            return
        if not line.strip():
            return
        yield line


if __name__ == "__main__":
    sys.exit(main())
