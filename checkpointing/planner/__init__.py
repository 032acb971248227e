"""The planner: which recompute (and offload) option each block gets, and what a step will cost.

It stands above the three strategies (checkpointing, offload, sharding) and decides for them;
what it decides is a list of `checkpointing.plan.BlockPlan`, the ground they stand on, which
never imports it. Its parts: `profile` (each block's options timed and measured on the device),
`metatrace` (bytes and FLOPs measured on the meta device, any model size), `memory` (the
per-rank memory model of a whole step), `search` (the exact choice of one option per block
under a byte budget), `policies` (the named policies and `budget` as plans) and `whole_step`
(`checkpointing=auto`: the fastest plan whose whole step fits a capacity).
"""
