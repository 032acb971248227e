"""Activation checkpointing: the per-block plan and carrying it out.

At this level, the ground `offload/` and `sharding/` also stand on: `plan` (the BlockPlan),
`blocks` (finding a model's blocks), `meter` (counting the bytes a step keeps for backward),
and what carries out recompute: `wrap` (the checkpoint wrapper), `compiled` (recompute placed
inside compiled blocks), `head` (the fused chunked loss head) and `tiles` (a module computed in
sequence tiles). Choosing the plan is the planner's, in `checkpointing.planner`; nothing at
this level imports it.
"""
