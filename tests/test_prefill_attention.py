"""pyhlo's prefill attention kernel (runtime/kernels/prefill_attention.cc): several new tokens a
row over its KV cache, causally, against numpy and against the program's own attention; and
where the decoder uses it."""
from __future__ import annotations

import numpy as np
import pytest
from hlo_run import run_fn
from hypothesis import given, settings
from hypothesis import strategies as st

from pyhlo.dtypes import numpy_dtype
from pyhlo.ops import elementwise as ew
from pyhlo.ops.attention import attention, prefill_attention_kernel
from pyhlo.ops.shape_ops import broadcast, iota
from pyhlo.shape_inference import HloShapeError
from runtime import cpu_kernels

pytestmark = pytest.mark.cpu_only


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_kernels.register(), "the CPU kernels did not build"


def reference(q, k, v, slot, pad, scale, window=None):
    """float64: query j of row i (slot[i] + j) over slots max(pad, its window) .. slot[i] + j."""
    b, h, n, d = q.shape
    group = h // k.shape[1]
    out = np.zeros((b, h, n, d))
    for i in range(b):
        for j in range(n):
            at = int(slot[i]) + j
            first = max(int(pad[i]), 0, at - window + 1 if window else 0)
            visible = slice(first, min(at, k.shape[2] - 1) + 1)
            for c in range(h):
                keys = k[i, c // group, visible].astype(np.float64)
                values = v[i, c // group, visible].astype(np.float64)
                if len(keys) == 0:
                    continue
                scores = keys @ q[i, c, j].astype(np.float64) * scale
                weights = np.exp(scores - scores.max())
                out[i, c, j] = weights @ values / weights.sum()
    return out


def packed_rows(rng, dims):
    """Packed int8 cache rows (d values, then the f32 scale's bytes) and what they stand for."""
    values = rng.integers(-127, 128, dims, dtype=np.int8)
    scales = rng.uniform(1e-3, 0.1, (*dims[:3], 1)).astype(np.float32)
    return np.concatenate([values, scales.view(np.int8)], axis=3), values * scales


# Rows at their own slots and padding (continuous batching), more cache lines than rows (each
# row naming its line), groups of query heads, tokens past a job's block of rows, slots past a
# block of 16, head sizes past the 16-value tiles and odd ones, windows, and every cache form.
@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 3), kvh=st.integers(1, 3), group=st.integers(1, 5), n=st.integers(2, 60),
       d=st.sampled_from([1, 7, 16, 24, 64, 80]), dtype=st.sampled_from(["f32", "bf16", "u16", "s8"]),
       more_lines=st.integers(0, 2), window=st.one_of(st.none(), st.integers(1, 50)), data=st.data())
def test_prefill_attention_kernel_matches_numpy(b, kvh, group, n, d, dtype, more_lines, window, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    s = n + data.draw(st.integers(0, 70))
    slot = np.array(data.draw(st.lists(st.integers(0, s - n), min_size=b, max_size=b)), np.int32)
    # Padding up to past the row's new tokens: its first queries see no slot.
    pad = np.array([data.draw(st.integers(0, int(first) + n + 1)) for first in slot], np.int32)
    n_lines = b + more_lines
    lines = rng.choice(n_lines, b, replace=False).astype(np.int32) if more_lines else None
    h = kvh * group
    q = rng.standard_normal((b, h, n, d)).astype(np.float32)
    dims = (n_lines, kvh, s, d)
    if dtype == "s8":
        (k, k_wide), (v, v_wide) = packed_rows(rng, dims), packed_rows(rng, dims)
    else:
        k_wide = k = rng.standard_normal(dims).astype(numpy_dtype("bf16" if dtype == "u16" else dtype))
        v_wide = v = rng.standard_normal(dims).astype(k.dtype)
        if dtype == "u16":
            k, v = k.view(np.uint16), v.view(np.uint16)
    scale = 1 / np.sqrt(d)

    def program(scribe):
        return prefill_attention_kernel(
            scribe.f32[q.shape].Parameter(parameter_number=0),
            getattr(scribe, dtype)[k.shape].Parameter(parameter_number=1),
            getattr(scribe, dtype)[v.shape].Parameter(parameter_number=2),
            scribe.s32[b].Parameter(parameter_number=3), scribe.s32[b].Parameter(parameter_number=4), scale,
            None if lines is None else scribe.s32[b].Parameter(parameter_number=5), window)

    (out,) = run_fn(program, q, k, v, slot, pad, *([] if lines is None else [lines]))
    read = np.arange(b) if lines is None else lines
    # f32 sums of values as large as the largest: absolute error in proportion to it.
    np.testing.assert_allclose(out, reference(q, k_wide[read], v_wide[read], slot, pad, scale, window),
                               rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(v_wide).max())))


@pytest.mark.parametrize("window", [None, 100])
def test_prefill_attention_kernel_matches_the_programs_own_attention(window):
    """A 300-token prompt of SmolLM2-135M's heads (9 query heads, 3 KV heads), left-padded by 5,
    from slot 0: the kernel and attention() under the decoder's masks agree to f32 rounding."""
    b, h, kvh, n, s, d = 1, 9, 3, 300, 320, 64
    rng = np.random.default_rng(0)
    q = rng.standard_normal((b, h, n, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, kvh, s, d)).astype(np.float32) for _ in range(2))
    pad = np.array([5], np.int32)

    def kernel(scribe):
        return prefill_attention_kernel(scribe.f32[q.shape].Parameter(parameter_number=0),
                                        scribe.f32[k.shape].Parameter(parameter_number=1),
                                        scribe.f32[v.shape].Parameter(parameter_number=2),
                                        ew.constant(scribe, "s32", 0, (b,)),
                                        scribe.s32[b].Parameter(parameter_number=3), 0.125, None, window)

    def program(scribe):
        from pyhlo.ops import nn

        pads = scribe.s32[b].Parameter(parameter_number=3)
        visible = nn.causal_mask(iota(scribe, "s32", (b, n), 1), s, window)
        past_pad = ew.compare(iota(scribe, "s32", (b, n, s), 2), broadcast(pads, (b, n, s), [0]), "GE")
        return attention(scribe.f32[q.shape].Parameter(parameter_number=0),
                         scribe.f32[k.shape].Parameter(parameter_number=1),
                         scribe.f32[v.shape].Parameter(parameter_number=2),
                         scribe.pred[b, n, s].And(visible, past_pad), 0.125)

    (ours,), (xla,) = run_fn(kernel, q, k, v, pad), run_fn(program, q, k, v, pad)
    # The first 5 queries see no slot: zeros from the kernel, an average of every slot from the
    # program's softmax over scores that are all masked. Neither reaches a real token.
    np.testing.assert_array_equal(ours[:, :, :5], 0.0)
    np.testing.assert_allclose(ours[:, :, 5:], xla[:, :, 5:], rtol=1e-4, atol=2e-6)


def test_prefill_attention_kernel_rejects_operands_it_cannot_run():
    def program(scribe):
        return prefill_attention_kernel(scribe.f32[1, 4, 3, 8].Parameter(parameter_number=0),
                                        scribe.f32[1, 3, 4, 8].Parameter(parameter_number=1),
                                        scribe.f32[1, 3, 4, 8].Parameter(parameter_number=2),
                                        scribe.s32[1].Parameter(parameter_number=3),
                                        scribe.s32[1].Parameter(parameter_number=4), 0.5)

    with pytest.raises(HloShapeError, match=r"q f32\[1, 4, 3, 8\], k f32\[1, 3, 4, 8\]"):
        shapes = [(1, 4, 3, 8), (1, 3, 4, 8), (1, 3, 4, 8)]
        run_fn(program, *(np.zeros(shape, np.float32) for shape in shapes), np.zeros(1, np.int32),
               np.zeros(1, np.int32))


def test_a_prompt_takes_the_kernel_where_it_is_fast(tiny_llama, monkeypatch):
    """A prompt's block calls the kernel where prefill_attention_is_fast(), else the program's
    own attention; the tokens are the same either way."""
    from decoders import LlamaForSampling
    from decoders.programs.keys import Block

    _, path = tiny_llama("gqa_tied_llama3", "safetensors")
    prompt = np.array([[5, 17, 3, 99, 42, 7, 8, 61, 2, 30, 11]], np.int64)
    tokens = {}
    for fast in (True, False):
        monkeypatch.setattr(cpu_kernels, "prefill_attention_is_fast", lambda fast=fast: fast)
        model = LlamaForSampling.from_pretrained(path, n_positions=64, context_length_estimate=[16])
        prefill = model.programs.build(Block(16, 16)).module.SerializeToString()
        assert (cpu_kernels.PREFILL_ATTENTION_TARGET.encode() in prefill) == fast
        model.to_neuron()
        tokens[fast] = model.sample(prompt, sequence_length=24, top_k=1)
    np.testing.assert_array_equal(np.asarray(tokens[True]), np.asarray(tokens[False]))
