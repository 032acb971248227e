"""Entry point `python -m trainer.generate` and `blocktrain-generate` (trainer/generate/cli.py)."""

import sys

from trainer.generate.cli import main

if __name__ == "__main__":
    sys.exit(main())
