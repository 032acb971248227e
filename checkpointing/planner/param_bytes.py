"""Bytes of one fully_shard group's parameters, by what each parameter is.

A trained parameter is stored sharded in the original dtype, all-gathered in the compute dtype,
and has a gradient (sharded, and unsharded in the compute dtype before its reduce-scatter) and
AdamW's two moments. A frozen one (model.freeze, the base under LoRA) has neither gradient nor
optimizer state. A parameter of a dtype FSDP's mixed precision does not cast (the 4-bit codes
and integer scalers of an NF4-quantized base, trainer/models/families/qlora.py) is stored and all-gathered
in its own dtype; the layer it belongs to makes its compute-dtype weight only while it runs (the
block's `transient_numel`: its largest dequantized weight, made again in backward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GroupBytes:
    params: int  # sharded, as stored
    trained: int  # sharded trained parameters in the original dtype = their sharded gradients
    gathered: int  # unsharded while the group computes: compute dtype, or stored dtype
    trained_exact: int  # elements of the trained parameters, unpadded
    trained_gathered: int  # elements of the trained parameters as all-gathered (padded)


def sharded_numel(shape: tuple[int, ...], shard: int) -> int:
    """FSDP2's local shard: dim 0 split in `shard` chunks of ceil(dim0 / shard) rows (padded)."""
    dims = shape or (1,)
    return math.ceil(dims[0] / shard) * math.prod(dims[1:])


def group_bytes(shapes, trained, itemsizes, floating, shard: int, orig: int, compute: int,
                transient_numel: int = 0) -> GroupBytes:
    """`itemsizes[i]`: the bytes of an element as stored (None: `orig`); `floating[i]`: mixed
    precision all-gathers it in the compute dtype (else as stored). `transient_numel`:
    compute-dtype elements made from the stored ones while the group computes (a dequantized
    weight), counted with the gathered bytes."""
    params = trained_bytes = gathered = exact = padded = 0
    for shape, is_trained, own, cast in zip(shapes, trained, itemsizes, floating, strict=True):
        stored = orig if own is None else own
        local = sharded_numel(shape, shard)
        params += local * stored
        gathered += local * shard * (compute if cast else stored)
        if is_trained:
            trained_bytes += local * stored
            exact += math.prod(shape or (1,))
            padded += local * shard
    return GroupBytes(params, trained_bytes, gathered + transient_numel * compute, exact, padded)
