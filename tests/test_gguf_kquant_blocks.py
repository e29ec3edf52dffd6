"""GGUF forms kept as the file's bytes (Q5_0, Q5_1, the K-quants, IQ4, and Q8_0 / Q4_0 / Q4_1
in rows of mixed forms): the program's unpacking reads random valid blocks bit for bit as the
gguf package's numpy dequantization does, rows of mixed forms too."""
from __future__ import annotations

import numpy as np
import pytest
from hlo_run import run_fn
from hypothesis import given, settings
from hypothesis import strategies as st

from pyhlo.ops.gguf_blocks import (
    LAYOUTS,
    ROW_CODES,
    ROW_TAIL,
    dequantize_gguf,
    dequantize_gguf_rows,
    pack_mixed_rows,
    unpack_mixed_rows,
)
from pyhlo.shape_inference import HloShapeError

# Byte offsets of each form's f16 fields (scale, minimum): random bytes elsewhere are valid.
HALVES = {"Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2),
          "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,), "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2)}


def random_gguf_blocks(ggml_type: str, rows: int, blocks: int, seed: int) -> np.ndarray:
    """Rows of random blocks of `ggml_type`, u8 [rows, blocks * bytes]: random bytes with each
    f16 field a finite number (some zero, some negative)."""
    rng = np.random.default_rng(seed)
    size = LAYOUTS[ggml_type][1]
    data = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    for start in HALVES[ggml_type]:
        halves = (rng.uniform(1e-3, 2, (rows, blocks)) * rng.choice([-1, 1, 0], (rows, blocks)))
        data[:, :, start:start + 2] = halves.astype(np.float16).reshape(rows, blocks, 1).view(np.uint8)
    return data.reshape(rows, blocks * size)


def gguf_dequantized(ggml_type: str, data: np.ndarray) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(data, gguf.GGMLQuantizationType[ggml_type])


@pytest.mark.parametrize("ggml_type", sorted(LAYOUTS))
@settings(max_examples=6, deadline=None)
@given(rows=st.integers(1, 9), blocks=st.integers(1, 3), seed=st.integers(0, 2**32 - 1))
def test_the_program_reads_the_blocks_as_the_gguf_package_does(ggml_type, rows, blocks, seed):
    data = random_gguf_blocks(ggml_type, rows, blocks, seed)

    def program(scribe):
        return dequantize_gguf(scribe.u8[data.shape].Parameter(parameter_number=0), ggml_type)

    (widened,) = run_fn(program, data)
    expected = gguf_dequantized(ggml_type, data)
    assert widened.shape == (rows, blocks * LAYOUTS[ggml_type][0]) == expected.shape
    np.testing.assert_array_equal(widened, expected)


def test_a_row_of_partial_blocks_is_a_shape_error():
    def program(scribe):
        return dequantize_gguf(scribe.u8[2, 150].Parameter(parameter_number=0), "Q4_K")

    with pytest.raises(HloShapeError, match="144-byte blocks"):
        run_fn(program, np.zeros((2, 150), np.uint8))


def mixed_rows(types: list[str], forms: tuple[str, ...], k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows each in its own form (types[i] for row i) as pack_mixed_rows lays out rows of
    `forms`; and the gguf package's reading of them."""
    rows = random_rows(types, k, seed)
    expected = [gguf_dequantized(t, row) for t, row in rows]
    return pack_mixed_rows(rows, k, forms), np.concatenate(expected)


def random_rows(types: list[str], k: int, seed: int) -> list[tuple[str, np.ndarray]]:
    """A random row of k values in each of `types`: (type, u8 [1, row bytes])."""
    return [(t, random_gguf_blocks(t, 1, k // LAYOUTS[t][0], seed + i)) for i, t in enumerate(types)]


def test_mixed_rows_lie_back_to_back_with_their_offsets_and_codes_after():
    """The layout itself, by hand: a Q4_0 row (18 bytes a block) then a Q8_0 row (34) of 64
    values, room for two Q8_0 rows."""
    q4, q8 = np.full((1, 36), 1, np.uint8), np.full((1, 68), 2, np.uint8)
    data = pack_mixed_rows([("Q4_0", q4), ("Q8_0", q8)], 64, ("Q4_0", "Q8_0"))
    assert data.shape == (2, 68 + ROW_TAIL)
    flat = data.reshape(-1)
    assert (flat[:36] == 1).all() and (flat[36:104] == 2).all() and (flat[104:136] == 0).all()
    assert list(flat[136:144].view("<u4")) == [0, 36]
    assert list(flat[144:]) == [ROW_CODES.index("Q4_0"), ROW_CODES.index("Q8_0")]
    back = unpack_mixed_rows(data, 64)
    assert [t for t, _ in back] == ["Q4_0", "Q8_0"]
    assert (back[0][1] == q4[0]).all() and (back[1][1] == q8[0]).all()
    with pytest.raises(ValueError, match="a Q6_K row among rows of Q4_0/Q8_0"):
        pack_mixed_rows([("Q6_K", np.zeros(210, np.uint8))], 256, ("Q4_0", "Q8_0"))


@settings(max_examples=10, deadline=None)
@given(types=st.lists(st.sampled_from(["Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q4_1"]), min_size=1, max_size=8),
       seed=st.integers(0, 2**32 - 1))
def test_rows_of_mixed_forms_read_as_each_rows_form(types, seed):
    forms = tuple(sorted(set(types) | {"Q6_K"}))       # a form no row has is harmless
    data, expected = mixed_rows(types, forms, 512, seed)

    def program(scribe):
        return dequantize_gguf_rows(scribe.u8[data.shape].Parameter(parameter_number=0), forms, 512)

    (widened,) = run_fn(program, data)
    np.testing.assert_array_equal(widened, expected)
