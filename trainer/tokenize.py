"""Entry point `python -m trainer.tokenize` (the code is trainer/data/tokenize.py)."""

import sys

from trainer.data.tokenize import main

if __name__ == "__main__":
    sys.exit(main())
