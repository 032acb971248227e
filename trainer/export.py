"""Entry point `python -m trainer.export` (the code is trainer/state/export.py)."""

import sys

from trainer.state.export import main

if __name__ == "__main__":
    sys.exit(main())
