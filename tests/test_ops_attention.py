"""Attention over a KV cache against a numpy reference: grouped-query heads, masks, ALiBi and full biases."""
from __future__ import annotations

import extra_ops
import numpy as np
import pytest
import torch
from hlo_run import run_fn
from hypothesis import given, settings
from hypothesis import strategies as st

from pyhlo import compile_py_func
from pyhlo.dtypes import numpy_dtype
from pyhlo.ops import nn
from pyhlo.ops.attention import attention, partial_attention

BF16 = numpy_dtype("bf16")
SETTINGS = settings(max_examples=12, deadline=None)
F32_LOWEST = np.finfo(np.float32).min


def reference(q, k, v, mask, scale, bias=None):
    """HF eager attention in float64: repeat_kv, scores, bias, mask, softmax, weighted sum."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = q @ k.swapaxes(-1, -2) * scale
    if bias is not None:
        scores = scores + (bias[None, :, None, :] if bias.ndim == 2 else bias)
    scores = np.where(mask[:, None], scores, F32_LOWEST)
    e = np.exp(scores - scores.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) @ v


def _param(scribe, dtype, dims, n):
    return getattr(scribe, dtype)[tuple(dims)].Parameter(parameter_number=n)


def _run(q, k, v, mask, scale, bias=None):
    def program(scribe):
        dtype = "bf16" if q.dtype == BF16 else "f32"
        b = _param(scribe, "f32", bias.shape, 4) if bias is not None else None
        return attention(_param(scribe, dtype, q.shape, 0), _param(scribe, dtype, k.shape, 1),
                         _param(scribe, dtype, v.shape, 2), _param(scribe, "pred", mask.shape, 3), scale, b)

    (out,) = run_fn(program, q, k, v, mask, *([bias] if bias is not None else []))
    return out


@st.composite
def problems(draw, dtype="f32"):
    b, kvh, group = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    nq, s, d = draw(st.integers(1, 4)), draw(st.integers(1, 6)), draw(st.integers(1, 8))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    np_dtype = numpy_dtype(dtype)
    q = rng.standard_normal((b, kvh * group, nq, d)).astype(np_dtype)
    k = rng.standard_normal((b, kvh, s, d)).astype(np_dtype)
    v = rng.standard_normal((b, kvh, s, d)).astype(np_dtype)
    mask = rng.random((b, nq, s)) < 0.7
    return q, k, v, mask


@SETTINGS
@given(problem=problems())
def test_grouped_query_attention_with_random_masks(problem):
    q, k, v, mask = problem
    scale = q.shape[-1] ** -0.5
    out = _run(q, k, v, mask, scale)
    assert out.shape == q.shape and out.dtype == np.float32
    np.testing.assert_allclose(out, reference(q, k, v, mask, scale), rtol=1e-5, atol=1e-5)


@SETTINGS
@given(problem=problems(), per_query=st.booleans())
def test_attention_with_bias(problem, per_query):
    q, k, v, mask = problem
    b, h, nq, _ = q.shape
    s = k.shape[2]
    rng = np.random.default_rng(0)
    bias = (rng.standard_normal((b, h, nq, s)) if per_query else -rng.random((h, s)) * s).astype(np.float32)
    out = _run(q, k, v, mask, 0.5, bias)
    np.testing.assert_allclose(out, reference(q, k, v, mask, 0.5, bias), rtol=1e-5, atol=1e-5)


@settings(max_examples=10, deadline=None)
@given(problem=problems("bf16"))
def test_bf16_attention(problem):
    q, k, v, mask = problem
    scale = q.shape[-1] ** -0.5
    out = _run(q, k, v, mask, scale)
    assert out.dtype == BF16
    # Scores and softmax are f32; the probabilities are rounded to bf16 before the product with v.
    np.testing.assert_allclose(out.astype(np.float32), reference(q, k, v, mask, scale), rtol=2e-2, atol=2e-2)


def test_causal_alibi_attention_matches_torch_sdpa():
    b, h, kvh, nq, s, d = 2, 6, 2, 3, 7, 4
    rng = np.random.default_rng(3)
    q = rng.standard_normal((b, h, nq, d)).astype(np.float32)
    k = rng.standard_normal((b, kvh, s, d)).astype(np.float32)
    v = rng.standard_normal((b, kvh, s, d)).astype(np.float32)
    positions = np.array([[4, 5, 6], [2, 3, 4]], np.int32)
    slopes = nn.alibi_slopes(h)

    def program(scribe):
        mask = nn.causal_mask(_param(scribe, "s32", positions.shape, 3), s)
        bias = extra_ops.alibi_bias(scribe, slopes, s)
        return attention(_param(scribe, "f32", q.shape, 0), _param(scribe, "f32", k.shape, 1),
                         _param(scribe, "f32", v.shape, 2), mask, d**-0.5, bias)

    (out,) = run_fn(program, q, k, v, positions)
    visible = torch.from_numpy(np.arange(s) <= positions[..., None])[:, None]
    alibi = torch.from_numpy(slopes[:, None] * np.arange(s, dtype=np.float32))[None, :, None, :]
    bias = torch.where(visible, alibi, torch.tensor(float("-inf")))
    expected = torch.nn.functional.scaled_dot_product_attention(
        torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), attn_mask=bias, enable_gqa=True
    )
    np.testing.assert_allclose(out, expected.numpy(), rtol=1e-5, atol=1e-5)


@SETTINGS
@given(problem=problems(), cut=st.floats(0, 1))
def test_attention_parts_combine_into_the_whole(problem, cut):
    """Flash decoding: partial_attention over two parts of the keys, combined as the replicas
    do (rescaled by exp(top - max top), summed, divided), is attention over all of them; a
    part no query can see (all masked) weighs nothing."""
    q, k, v, mask = problem
    mask[..., -1] = True        # every query sees a key somewhere
    s = k.shape[2]
    split = int(round(cut * s))
    scale = q.shape[-1] ** -0.5
    parts = []
    for keys in (slice(0, split), slice(split, s)):
        if keys.start == keys.stop:
            continue

        def program(scribe, keys=keys):
            width = keys.stop - keys.start
            return partial_attention(_param(scribe, "f32", q.shape, 0),
                                     _param(scribe, "f32", (*k.shape[:2], width, k.shape[3]), 1),
                                     _param(scribe, "f32", (*v.shape[:2], width, v.shape[3]), 2),
                                     _param(scribe, "pred", (*mask.shape[:2], width), 3), scale)

        sliced = [np.ascontiguousarray(a[..., keys, :]) for a in (k, v)]
        parts.append(run_fn(program, q, *sliced, np.ascontiguousarray(mask[..., keys])))
    highest = np.max([top for _, top, _ in parts], axis=0)
    out = sum(o * np.exp(top - highest)[..., None] for o, top, _ in parts)
    total = sum(t * np.exp(top - highest) for _, top, t in parts)
    np.testing.assert_allclose(out / total[..., None], reference(q, k, v, mask, scale), rtol=1e-5, atol=1e-5)
    unseen = ~mask[..., :split].any(-1)     # [b, nq]: queries that see nothing of the first part
    if split and unseen.any():
        out0, top0, total0 = parts[0]
        lines, queries = np.nonzero(unseen)
        assert (total0[lines, :, queries] == 0).all() and (out0[lines, :, queries] == 0).all()
        assert (top0[lines, :, queries] == F32_LOWEST).all()


def test_fully_masked_rows_give_no_nan():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 2, 2, 4)).astype(np.float32)
    k = rng.standard_normal((1, 1, 3, 4)).astype(np.float32)
    v = rng.standard_normal((1, 1, 3, 4)).astype(np.float32)
    mask = np.array([[[True, True, False], [False, False, False]]])
    out = _run(q, k, v, mask, 0.5)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out[0, :, 1], np.broadcast_to(v[0, 0].mean(0), (2, 4)), rtol=1e-5)


def test_the_cache_is_read_in_place():
    """One batched dot per product straight from the k and v parameters: no repeat, no transpose."""

    def program(scribe):
        q = _param(scribe, "f32", (2, 8, 1, 16), 0)
        k = _param(scribe, "f32", (2, 2, 32, 16), 1)
        v = _param(scribe, "f32", (2, 2, 32, 16), 2)
        return attention(q, k, v, _param(scribe, "pred", (2, 1, 32), 3), 0.25)

    entry = compile_py_func(program).computations[-1]
    by_id = {i.id: i for i in entry.instructions}
    opcodes = [i.opcode for i in entry.instructions]
    assert "transpose" not in opcodes
    dots = [i for i in entry.instructions if i.opcode == "dot"]
    assert len(dots) == 2
    assert [by_id[d.operand_ids[1]].parameter_number for d in dots] == [1, 2]
    assert all(by_id[d.operand_ids[1]].opcode == "parameter" for d in dots)


def test_bad_shapes_are_reported():
    def program(scribe):
        q = _param(scribe, "f32", (1, 3, 1, 4), 0)
        k = _param(scribe, "f32", (1, 2, 5, 4), 1)
        return attention(q, k, k, None, 1.0)

    with pytest.raises(ValueError, match="3 query heads are not a multiple of 2 kv heads"):
        compile_py_func(program)
