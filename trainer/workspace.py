"""Entry point `python -m trainer.workspace` (the code is trainer/observe/workspace.py)."""

import sys

from trainer.observe.workspace import main

if __name__ == "__main__":
    sys.exit(main())
