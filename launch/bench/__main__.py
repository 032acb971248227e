"""`python -m launch.bench`: the policy tables, or the bench a flag names (policies.py)."""

import sys

from launch.bench.policies import main

sys.exit(main())
