"""GGUF block forms (Q8_0, Q4_0, Q4_1): the program's dequantization equals numpy's, which
equals the gguf package's own reading of the same blocks."""
from __future__ import annotations

import numpy as np
import pytest
from hlo_run import run_fn
from hypothesis import given, settings
from hypothesis import strategies as st

from decoders.weights.quantize import dequantize_blocks
from decoders.weights.stored import BlockWeight
from pyhlo.ops.quantized import dequantize_blocks as dequantize_in_program
from pyhlo.shape_inference import HloShapeError

FORMS = ("q8_0", "q4_0", "q4_1")


def random_blocks(form: str, rows: int, width: int, seed: int) -> BlockWeight:
    rng = np.random.default_rng(seed)
    blocks = width // 32
    scales = (rng.uniform(1e-3, 10, (rows, blocks))
              * rng.choice([-1, 1, 0], (rows, blocks))).astype(np.float16)
    mins = rng.uniform(-10, 10, (rows, blocks)).astype(np.float16) if form == "q4_1" else None
    if form == "q8_0":
        values = rng.integers(-128, 128, (rows, width), dtype=np.int8)
    else:
        values = rng.integers(0, 256, (rows, width // 2), dtype=np.uint8)
    return BlockWeight(form, values, scales, mins)


def gguf_bytes(weight: BlockWeight) -> np.ndarray:
    """The blocks as a GGUF file stores them: f16 scale (f16 minimum), then the values."""
    rows, blocks = weight.scales.shape
    parts = [weight.scales.reshape(rows, blocks, 1).view(np.uint8)]
    if weight.mins is not None:
        parts.append(weight.mins.reshape(rows, blocks, 1).view(np.uint8))
    parts.append(weight.values.reshape(rows, blocks, -1).view(np.uint8))
    return np.concatenate(parts, axis=2).reshape(rows, -1)


@settings(max_examples=20, deadline=None)
@given(form=st.sampled_from(FORMS), rows=st.integers(1, 20), blocks=st.integers(1, 6),
       seed=st.integers(0, 2**32 - 1))
def test_numpy_reads_the_blocks_as_the_gguf_package_does(form, rows, blocks, seed):
    import gguf

    weight = random_blocks(form, rows, 32 * blocks, seed)
    kind = getattr(gguf.GGMLQuantizationType, form.upper())
    np.testing.assert_array_equal(dequantize_blocks(weight), gguf.quants.dequantize(gguf_bytes(weight), kind))


@settings(max_examples=15, deadline=None)
@given(form=st.sampled_from(FORMS), rows=st.integers(1, 20), blocks=st.integers(1, 6),
       seed=st.integers(0, 2**32 - 1))
def test_the_program_dequantizes_exactly_as_numpy(form, rows, blocks, seed):
    weight = random_blocks(form, rows, 32 * blocks, seed)
    arrays = [a for a in weight[1:] if a is not None]

    def program(scribe):
        params = [getattr(scribe, {"int8": "s8", "uint8": "u8", "float16": "f16"}[a.dtype.name])[a.shape]
                  .Parameter(parameter_number=i) for i, a in enumerate(arrays)]
        return dequantize_in_program(*params)

    (widened,) = run_fn(program, *arrays)
    np.testing.assert_array_equal(widened, dequantize_blocks(weight))


def test_mismatched_block_arrays_are_shape_errors():
    def program(scribe):
        values = scribe.u8[4, 16].Parameter(parameter_number=0)
        scales = scribe.f16[4, 2].Parameter(parameter_number=1)    # 16 bytes are one block, not two
        return dequantize_in_program(values, scales)

    with pytest.raises(HloShapeError, match="f16 scales"):
        run_fn(program, np.zeros((4, 16), np.uint8), np.zeros((4, 2), np.float16))
