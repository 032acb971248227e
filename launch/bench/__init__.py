"""The benchmark room: every benchmark and the plain-PyTorch reference, in one place.

`python -m launch.bench` (policies.py: the checkpoint policies and offload targets through the
real trainer, `auto` against the uniform policies, our planner against torch.compile's, and with
`--reference` blocktrain against a plain PyTorch loop: reference.py, which counts each step with
stepcount.py and lets the two programs take turns with turns.py); `plain.py`, that plain loop
(also the GPU check's reference); `paired.py`, our block plan against the plain loop's wrapping
in one process; `head.py`, the chunked loss head against the plain one; `data.py`, the data
pipeline. Their records: BENCHMARKS.md and DATA_BENCHMARKS.md. Only `launch/` (and the tests)
import from here; the trainer and the strategies never do.
"""
