"""The work inside pyhlo's CPU kernels, which XLA's cost analysis cannot see.

XLA counts a custom call as no work at all, so a decode program whose products run in
runtime/cpu_kernels.py looks almost free. This module counts each kernel call from its
operand and result shapes in the HloModuleProto (pure Python; nothing is compiled):

    costs = module_kernel_costs(hlo_pb2.HloModuleProto.FromString(module_bytes))
    costs.total.flops, costs.total.bytes_accessed, costs.calls   # {"pyhlo_matvec_q4_1": 120, ...}

FLOPs are 2 per multiply-add of the product the kernel computes (the matrix product, or
attention's q.k and p.v); bytes are every operand read once plus the result written once.
The decode attention kernel reads only each line's filled cache slots, which are run-time
values: it is counted reading the whole cache, an upper bound (KernelCost.upper_bound).
Each call is counted once, as written in the module.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Callable, Sequence

from pyhlo import dtypes
from pyhlo.schema import hlo_pb2
from runtime import cpu_kernels

CUSTOM_CALL = "custom-call"


@dataclasses.dataclass(frozen=True)
class KernelCost:
    """The work of one kernel call, or of several summed with +."""

    flops: int = 0
    transcendentals: int = 0
    bytes_accessed: int = 0
    upper_bound: bool = False  # some reads depend on run-time values and were counted whole

    def __add__(self, other: KernelCost) -> KernelCost:
        return KernelCost(self.flops + other.flops, self.transcendentals + other.transcendentals,
                          self.bytes_accessed + other.bytes_accessed, self.upper_bound or other.upper_bound)


@dataclasses.dataclass(frozen=True)
class ModuleKernelCosts:
    """The work of every pyhlo kernel call of a module, and the custom calls left uncounted."""

    total: KernelCost = KernelCost()
    calls: dict[str, int] = dataclasses.field(default_factory=dict)      # our kernels' targets -> calls
    uncounted: dict[str, int] = dataclasses.field(default_factory=dict)  # other targets -> calls
    upper_bound_targets: tuple[str, ...] = ()  # targets counted with run-time-dependent reads whole


def shape_bytes(shape: hlo_pb2.ShapeProto) -> int:
    """Bytes of an array shape, or of every array of a tuple (tokens and unknown types count zero)."""
    if shape.element_type == hlo_pb2.TUPLE:
        return sum(shape_bytes(s) for s in shape.tuple_shapes)
    name = dtypes.NAME_OF_PRIMITIVE.get(shape.element_type)
    return 0 if name is None else math.prod(shape.dimensions) * dtypes.byte_size(name)


def _moved(operands: Sequence[hlo_pb2.ShapeProto], result: hlo_pb2.ShapeProto) -> int:
    return sum(shape_bytes(s) for s in operands) + shape_bytes(result)


def matvec_cost(operands: Sequence[hlo_pb2.ShapeProto], result: hlo_pb2.ShapeProto) -> KernelCost:
    """x f32[..., k] times a weight matrix of n rows -> f32[..., n] (every matvec form: f32/bf16,
    s8 with per-row scales, GGUF blocks; the int8 prefill GEMM too): 2 * rows * k * n FLOPs, where
    rows is the product of x's leading dimensions. The weights' form only changes the bytes read
    (values, scales, mins)."""
    x = operands[0]
    rows, k, n = math.prod(x.dimensions[:-1]), x.dimensions[-1], result.dimensions[-1]
    return KernelCost(flops=2 * rows * k * n, bytes_accessed=_moved(operands, result))


def decode_attention_cost(operands: Sequence[hlo_pb2.ShapeProto], result: hlo_pb2.ShapeProto) -> KernelCost:
    """q f32[b, h, 1, d] over caches k, v [b, kvh, S, d (+ 4 for packed int8 rows)]: q.k and p.v are
    2 * b * h * S * d FLOPs each and the softmax b * h * S exponentials, all S slots counted: the
    kernel reads only slots pad[i]..slot[i], known at run time, so this is an upper bound."""
    q, k = operands[0], operands[1]
    b, h, _, d = q.dimensions
    slots = k.dimensions[2]
    return KernelCost(flops=4 * b * h * slots * d, transcendentals=b * h * slots,
                      bytes_accessed=_moved(operands, result), upper_bound=True)


def prefill_attention_cost(operands: Sequence[hlo_pb2.ShapeProto], result: hlo_pb2.ShapeProto) -> KernelCost:
    """q f32[b, h, n, d] over caches k, v [B, kvh, S, d (+ 4)]: counted as decode_attention_cost
    counts one query, for each of the n (every slot of S seen: an upper bound; a causal prompt
    sees about half of them)."""
    q, k = operands[0], operands[1]
    b, h, n, d = q.dimensions
    slots = k.dimensions[2]
    return KernelCost(flops=4 * b * h * n * slots * d, transcendentals=b * h * n * slots,
                      bytes_accessed=_moved(operands, result), upper_bound=True)


def rotary_cos_sin_cost(operands: Sequence[hlo_pb2.ShapeProto], result: hlo_pb2.ShapeProto) -> KernelCost:
    """cos and sin of P positions times E frequencies: P * E products, 2 P E transcendentals."""
    count = math.prod(result.dimensions) // 2
    return KernelCost(flops=count, transcendentals=2 * count, bytes_accessed=_moved(operands, result))


CostRule = Callable[[Sequence[hlo_pb2.ShapeProto], hlo_pb2.ShapeProto], KernelCost]
# custom-call target -> how its work is counted; every kernel runtime.cpu_kernels registers.
COST_RULES: dict[str, CostRule] = {
    cpu_kernels.MATVEC_TARGET: matvec_cost,
    cpu_kernels.MATVEC_S8_TARGET: matvec_cost,
    **{target: matvec_cost for target in cpu_kernels.MATVEC_BLOCK_TARGETS.values()},
    **{target: matvec_cost for target in cpu_kernels.MATVEC_BLOCK_X8_TARGETS.values()},
    **{target: matvec_cost for target in cpu_kernels.GEMM_BLOCK_TARGETS.values()},
    **{target: matvec_cost for target in cpu_kernels.GEMM_BLOCK_X8_TARGETS.values()},
    **{target: matvec_cost for target in cpu_kernels.GEMM_GGUF_X8_TARGETS.values()},
    cpu_kernels.GEMM_GGUF_ROWS_X8_TARGET: matvec_cost,
    **{target: matvec_cost for target in cpu_kernels.GEMM_GGUF32_X8_TARGETS.values()},
    cpu_kernels.GEMM_GGUF_ROWS32_X8_TARGET: matvec_cost,
    cpu_kernels.GEMM_S8_X8_TARGET: matvec_cost,
    cpu_kernels.GEMM_S8_TARGET: matvec_cost,
    cpu_kernels.GEMM_BF16_TARGET: matvec_cost,
    **{target: matvec_cost for target in cpu_kernels.MATVEC_GGUF_TARGETS.values()},
    **{target: matvec_cost for target in cpu_kernels.MATVEC_GGUF_X8_TARGETS.values()},
    cpu_kernels.MATVEC_GGUF_ROWS_TARGET: matvec_cost,
    **{target: matvec_cost for target in cpu_kernels.GEMM_GGUF_TARGETS.values()},
    cpu_kernels.GEMM_GGUF_ROWS_TARGET: matvec_cost,
    cpu_kernels.MATVEC_GGUF_ROWS_X8_TARGET: matvec_cost,
    cpu_kernels.ROTARY_COS_SIN_TARGET: rotary_cos_sin_cost,
    cpu_kernels.DECODE_ATTENTION_TARGET: decode_attention_cost,
    cpu_kernels.PREFILL_ATTENTION_TARGET: prefill_attention_cost,
}


def call_cost(instruction: hlo_pb2.HloInstructionProto,
              shapes_by_id: dict[int, hlo_pb2.ShapeProto]) -> KernelCost | None:
    """The work of one custom-call instruction, or None when its target is not a pyhlo kernel.
    `shapes_by_id` maps the ids of the instructions of its computation to their shapes."""
    rule = COST_RULES.get(instruction.custom_call_target)
    if rule is None:
        return None
    return rule([shapes_by_id[i] for i in instruction.operand_ids], instruction.shape)


def module_kernel_costs(module: hlo_pb2.HloModuleProto) -> ModuleKernelCosts:
    """The summed work of every pyhlo kernel call in the module's computations."""
    total = KernelCost()
    calls: collections.Counter[str] = collections.Counter()
    uncounted: collections.Counter[str] = collections.Counter()
    bounded: dict[str, None] = {}
    for computation in module.computations:
        shapes_by_id = {i.id: i.shape for i in computation.instructions}
        for instruction in computation.instructions:
            if instruction.opcode != CUSTOM_CALL:
                continue
            target = instruction.custom_call_target
            cost = call_cost(instruction, shapes_by_id)
            if cost is None:
                uncounted[target] += 1
                continue
            calls[target] += 1
            total += cost
            if cost.upper_bound:
                bounded[target] = None
    return ModuleKernelCosts(total, dict(calls), dict(uncounted), tuple(bounded))
