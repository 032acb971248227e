"""`python -m launch.bench`: the policy tables, or the bench a flag names (policies.py;
`--sequence`: sequence.py, which reuses policies.py's runner)."""

import sys

if "--sequence" in sys.argv[1:]:
    from launch.bench.sequence import main

    sys.exit(main([a for a in sys.argv[1:] if a != "--sequence"]))

from launch.bench.policies import main

sys.exit(main())
