"""Neural-network composites against torch and HF transformers' own modules."""
from __future__ import annotations

import extra_ops
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hlo_run import run_fn
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaConfig
from transformers.models.bloom.modeling_bloom import build_alibi_tensor
from transformers.models.gptj import modeling_gptj
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from pyhlo import compile_py_func
from pyhlo.dtypes import numpy_dtype
from pyhlo.ops import nn
from pyhlo.ops.shape_ops import broadcast

BF16 = numpy_dtype("bf16")
SETTINGS = settings(max_examples=12, deadline=None)
shapes = st.lists(st.integers(1, 6), min_size=1, max_size=4).map(tuple)
seeds = st.integers(0, 2**32 - 1)
float_types = st.sampled_from(["f32", "bf16"])


def _param(scribe, dtype, dims, n=0):
    return getattr(scribe, dtype)[tuple(dims)].Parameter(parameter_number=n)


def _randn(seed, dims, dtype="f32", scale=1.0):
    return (np.random.default_rng(seed).standard_normal(dims) * scale).astype(numpy_dtype(dtype))


def _torch(x):
    return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16 if x.dtype == BF16 else torch.float32)


def _numpy(t):
    return t.float().numpy()


TOLERANCE = {"f32": dict(rtol=1e-5, atol=1e-6), "bf16": dict(rtol=1e-2, atol=1e-2)}


@pytest.mark.quick
@SETTINGS
@given(dims=shapes, seed=seeds, dtype=float_types, data=st.data())
def test_softmax(dims, seed, dtype, data):
    dim = data.draw(st.integers(-len(dims), len(dims) - 1))
    x = _randn(seed, dims, dtype, scale=5.0)
    (out,) = run_fn(lambda scribe: nn.softmax(_param(scribe, dtype, dims), dim), x)
    assert out.dtype == x.dtype
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=dim, keepdims=True))
    np.testing.assert_allclose(out.astype(np.float64), e / e.sum(axis=dim, keepdims=True), **TOLERANCE[dtype])


def test_softmax_is_stable_for_large_logits():
    x = np.array([[1000.0, 999.0, -1000.0], [-3e38, -3e38, -3e38]], np.float32)
    (out,) = run_fn(lambda scribe: nn.softmax(_param(scribe, "f32", (2, 3))), x)
    e = np.exp([0.0, -1.0])
    np.testing.assert_allclose(out[0], [e[0] / e.sum(), e[1] / e.sum(), 0.0], rtol=1e-6)
    np.testing.assert_allclose(out[1], [1 / 3] * 3, rtol=1e-6)


@pytest.mark.quick
@SETTINGS
@given(lead=st.lists(st.integers(1, 4), max_size=2), hidden=st.integers(1, 16), seed=seeds, dtype=float_types)
def test_rms_norm_matches_hf_llama(lead, hidden, seed, dtype):
    x = _randn(seed, (*lead, hidden), dtype, scale=3.0)
    weight = _randn(seed + 1, (hidden,), dtype)
    eps = 1e-5

    def program(scribe):
        return nn.rms_norm(_param(scribe, dtype, x.shape, 0), _param(scribe, dtype, (hidden,), 1), eps)

    (out,) = run_fn(program, x, weight)
    norm = LlamaRMSNorm(hidden, eps=eps).to(_torch(weight).dtype)
    with torch.no_grad():
        norm.weight.copy_(_torch(weight))
        expected = _numpy(norm(_torch(x)))
    assert out.dtype == x.dtype
    np.testing.assert_allclose(out.astype(np.float32), expected, **TOLERANCE[dtype])


@SETTINGS
@given(lead=st.lists(st.integers(1, 4), max_size=2), hidden=st.integers(2, 16), seed=seeds, dtype=float_types,
       with_bias=st.booleans())
def test_layer_norm_matches_torch(lead, hidden, seed, dtype, with_bias):
    x = _randn(seed, (*lead, hidden), dtype, scale=3.0) + 2  # an offset the mean must remove
    weight = _randn(seed + 1, (hidden,), dtype)
    bias = _randn(seed + 2, (hidden,), dtype)

    def program(scribe):
        b = _param(scribe, dtype, (hidden,), 2) if with_bias else None
        return nn.layer_norm(_param(scribe, dtype, x.shape, 0), _param(scribe, dtype, (hidden,), 1), b, 1e-5)

    (out,) = run_fn(program, x, weight, *([bias] if with_bias else []))
    expected = F.layer_norm(_torch(x), (hidden,), _torch(weight), _torch(bias) if with_bias else None, 1e-5)
    assert out.dtype == x.dtype
    np.testing.assert_allclose(out.astype(np.float32), _numpy(expected),
                               rtol=1e-4 if dtype == "f32" else 2e-2, atol=1e-4 if dtype == "f32" else 2e-2)


@SETTINGS
@given(dims=shapes, seed=seeds, dtype=float_types)
def test_activations_match_torch(dims, seed, dtype):
    x = _randn(seed, dims, dtype, scale=3.0)

    def program(scribe):
        a = _param(scribe, dtype, dims)
        return [nn.gelu(a), nn.gelu(a, approximate="tanh"), nn.silu(a), nn.relu(a)]

    gelu, gelu_tanh, silu, relu = run_fn(program, x)
    for out, expected in [(gelu, F.gelu(_torch(x))), (gelu_tanh, F.gelu(_torch(x), approximate="tanh")),
                          (silu, F.silu(_torch(x))), (relu, F.relu(_torch(x)))]:
        assert out.dtype == x.dtype
        np.testing.assert_allclose(out.astype(np.float32), _numpy(expected), **ACTIVATION_TOLERANCE[dtype])


# XLA:CPU's f32 logistic and erf are within about 1.3e-6 absolute of float64 over [-30, 30]
# (e.g. silu(-8.7) = -1.48e-3 off by 1.1e-6): more than TOLERANCE's 1e-6 on small outputs.
ACTIVATION_TOLERANCE = {**TOLERANCE, "f32": dict(rtol=1e-5, atol=2e-6)}


def test_unknown_activation_names_the_valid_ones():
    with pytest.raises(ValueError, match="gelu: approximate must be 'none' or 'tanh'"):
        compile_py_func(lambda scribe: nn.gelu(_param(scribe, "f32", (2,)), approximate="erf"))
    with pytest.raises(ValueError, match="unknown activation 'quick_gelu'; valid: silu, swish, gelu, "):
        nn.activation_fn("quick_gelu")
    assert nn.activation_fn("gelu_new") is nn.activation_fn("gelu_pytorch_tanh")


@SETTINGS
@given(lead=st.lists(st.integers(1, 3), min_size=1, max_size=2), hidden=st.integers(1, 8),
       inter=st.integers(1, 12), activation=st.sampled_from(["silu", "gelu", "gelu_tanh"]), seed=seeds)
def test_gated_mlp_f32(lead, hidden, inter, activation, seed):
    x = _randn(seed, (*lead, hidden))
    gate, up, down = (_randn(seed + 1, (hidden, inter)), _randn(seed + 2, (hidden, inter)),
                      _randn(seed + 3, (inter, hidden)))

    def program(scribe):
        ws = [_param(scribe, "f32", w.shape, i + 1) for i, w in enumerate((gate, up, down))]
        return extra_ops.gated_mlp(_param(scribe, "f32", x.shape), *ws, activation=activation)

    (out,) = run_fn(program, x, gate, up, down)
    act = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[activation]
    tx, tg, tu, td = map(torch.from_numpy, (x, gate, up, down))
    expected = (act(tx @ tg) * (tx @ tu)) @ td
    np.testing.assert_allclose(out, expected.numpy(), rtol=1e-4, atol=1e-5)


def test_gated_mlp_bf16_accumulates_in_f32():
    x = _randn(0, (2, 16), "bf16")
    gate, up, down = _randn(1, (16, 32), "bf16"), _randn(2, (16, 32), "bf16"), _randn(3, (32, 16), "bf16")

    def program(scribe):
        ws = [_param(scribe, "bf16", w.shape, i + 1) for i, w in enumerate((gate, up, down))]
        return extra_ops.gated_mlp(_param(scribe, "bf16", x.shape), *ws)

    (out,) = run_fn(program, x, gate, up, down)
    f = [torch.from_numpy(a.astype(np.float32)) for a in (x, gate, up, down)]
    hidden = (F.silu(f[0] @ f[1]) * (f[0] @ f[2])).to(torch.bfloat16).float()
    expected = (hidden @ f[3]).numpy()
    assert out.dtype == BF16
    np.testing.assert_allclose(out.astype(np.float32), expected, rtol=1e-2, atol=0.1)


# -- rotary embeddings ---------------------------------------------------------

def _llama_rotary(head_dim, theta=10000.0):
    config = LlamaConfig(hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim, rope_theta=theta)
    return LlamaRotaryEmbedding(config)


@SETTINGS
@given(batch=st.integers(1, 3), heads=st.integers(1, 3), seq=st.integers(1, 5),
       half_dim=st.integers(1, 8), seed=seeds, dtype=float_types)
def test_rotary_half_matches_hf_llama(batch, heads, seq, half_dim, seed, dtype):
    head_dim = 2 * half_dim
    rotary = _llama_rotary(head_dim, theta=500.0)
    positions = np.random.default_rng(seed).integers(0, 2048, (batch, seq)).astype(np.int32)
    q = _randn(seed, (batch, heads, seq, head_dim), dtype)
    k = _randn(seed + 1, (batch, 1, seq, head_dim), dtype)

    def program(scribe):
        cos, sin = nn.rotary_cos_sin(_param(scribe, "s32", positions.shape, 0), rotary.inv_freq.numpy())
        outs = []
        for i, x in enumerate((q, k)):
            value = _param(scribe, dtype, x.shape, i + 1)
            # cos/sin are [batch, seq, head_dim]: put them on each head.
            c, s = (broadcast(t, x.shape, [0, 2, 3]) for t in (cos, sin))
            outs.append(nn.apply_rotary(value, c, s))
        return [cos, sin, *outs]

    cos, sin, q_out, k_out = run_fn(program, positions, q, k)
    ref_cos, ref_sin = rotary(torch.zeros(1), torch.from_numpy(positions).long())
    np.testing.assert_allclose(cos, ref_cos.numpy(), rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(sin, ref_sin.numpy(), rtol=1e-5, atol=2e-6)
    # HF rotates in the activations' type; we rotate in f32 and round once.
    ref_q, ref_k = apply_rotary_pos_emb(_torch(q).float(), _torch(k).float(), ref_cos, ref_sin)
    assert q_out.dtype == q.dtype
    np.testing.assert_allclose(q_out.astype(np.float32), ref_q.numpy(), **TOLERANCE[dtype])
    np.testing.assert_allclose(k_out.astype(np.float32), ref_k.numpy(), **TOLERANCE[dtype])


@SETTINGS
@given(batch=st.integers(1, 2), heads=st.integers(1, 3), seq=st.integers(1, 5), half_rotary=st.integers(1, 4),
       extra=st.integers(0, 4), seed=seeds)
def test_rotary_interleaved_partial_matches_hf_gptj(batch, heads, seq, half_rotary, extra, seed):
    rotary_dim, head_dim = 2 * half_rotary, 2 * half_rotary + extra
    positions = np.random.default_rng(seed).integers(0, 64, (batch, seq)).astype(np.int32)
    # GPT-J keeps queries as [batch, seq, heads, head_dim].
    x = _randn(seed, (batch, seq, heads, head_dim))
    inv_freq = 1.0 / (10000 ** (np.arange(0, rotary_dim, 2, dtype=np.int64) / rotary_dim))

    def program(scribe):
        cos, sin = nn.rotary_cos_sin(_param(scribe, "s32", positions.shape, 0), inv_freq, style="interleaved")
        dims = (batch, seq, heads, rotary_dim)
        c, s = (broadcast(t, dims, [0, 1, 3]) for t in (cos, sin))
        return nn.apply_rotary_partial(_param(scribe, "f32", x.shape, 1), c, s, rotary_dim,
                                       style="interleaved")

    (out,) = run_fn(program, positions, x)
    table = modeling_gptj.create_sinusoidal_positions(64, rotary_dim)[torch.from_numpy(positions).long()]
    sin, cos = torch.split(table, rotary_dim // 2, dim=-1)
    tx = torch.from_numpy(x)
    rotated = modeling_gptj.apply_rotary_pos_emb(tx[..., :rotary_dim], sin, cos)
    expected = torch.cat([rotated, tx[..., rotary_dim:]], dim=-1)
    np.testing.assert_allclose(out, expected.numpy(), rtol=1e-5, atol=1e-5)


def test_rotary_half_partial_leaves_the_tail_alone():
    x = _randn(0, (1, 2, 3, 6))
    positions = np.array([[0, 5, 9]], np.int32)
    inv_freq = np.array([1.0, 0.1], np.float32)

    def program(scribe):
        cos, sin = nn.rotary_cos_sin(_param(scribe, "s32", (1, 3), 0), inv_freq)
        c, s = (broadcast(t, (1, 2, 3, 4), [0, 2, 3]) for t in (cos, sin))
        return nn.apply_rotary_partial(_param(scribe, "f32", x.shape, 1), c, s, rotary_dim=4)

    (out,) = run_fn(program, positions, x)
    angles = positions[0, :, None] * np.concatenate([inv_freq, inv_freq])
    head = torch.from_numpy(x[..., :4])
    ref, _ = apply_rotary_pos_emb(head, head, torch.from_numpy(np.cos(angles))[None],
                                  torch.from_numpy(np.sin(angles))[None])
    np.testing.assert_allclose(out[..., :4], ref.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out[..., 4:], x[..., 4:])


# -- masks and ALiBi ---------------------------------------------------------------

@SETTINGS
@given(batch=st.integers(1, 3), n_q=st.integers(1, 4), n_keys=st.integers(1, 8),
       window=st.one_of(st.none(), st.integers(1, 4)), seed=seeds)
def test_causal_mask(batch, n_q, n_keys, window, seed):
    positions = np.random.default_rng(seed).integers(0, n_keys + 2, (batch, n_q)).astype(np.int32)
    (mask,) = run_fn(lambda scribe: nn.causal_mask(_param(scribe, "s32", (batch, n_q)), n_keys, window),
                     positions)
    keys = np.arange(n_keys)
    pos = positions[..., None]
    expected = (keys <= pos) & ((pos - keys < window) if window else True)
    assert mask.dtype == np.bool_ and mask.shape == (batch, n_q, n_keys)
    np.testing.assert_array_equal(mask, expected)


@pytest.mark.parametrize("n_heads", [1, 2, 5, 6, 8, 12, 16, 24, 32, 40])
def test_alibi_slopes_match_hf_bloom(n_heads):
    ones = torch.ones(1, 7, dtype=torch.long)
    hf = build_alibi_tensor(ones, n_heads, torch.float32)  # [heads, 1, keys] = slope * key index
    np.testing.assert_allclose(nn.alibi_slopes(n_heads), hf[:, 0, 1].numpy(), rtol=1e-6)


def test_alibi_bias_matches_hf_bloom():
    n_heads, n_keys = 12, 9
    slopes = nn.alibi_slopes(n_heads)
    (bias,) = run_fn(lambda scribe: extra_ops.alibi_bias(scribe, slopes, n_keys))
    hf = build_alibi_tensor(torch.ones(1, n_keys, dtype=torch.long), n_heads, torch.float32)[:, 0, :]
    np.testing.assert_allclose(bias, hf.numpy(), rtol=1e-6)


# -- precision ------------------------------------------------------------------

@pytest.mark.parametrize("amp, name", [("f32", "f32"), ("float32", "f32"), ("bf16", "bf16"),
                                       ("bfloat16", "bf16"), ("f16", "f16"), ("float16", "f16")])
def test_compute_dtype(amp, name):
    assert extra_ops.compute_dtype(amp) == name


def test_compute_dtype_lists_the_valid_names():
    with pytest.raises(ValueError, match=r"unknown amp dtype 'int8'; valid names: .*bfloat16.*float32"):
        extra_ops.compute_dtype("int8")


def test_upcast_and_downcast():
    x = np.array([1.0, 1.0 + 2**-10, -3.3], np.float32)

    def program(scribe):
        low = extra_ops.downcast(_param(scribe, "f32", (3,)), "bf16")
        return [low, extra_ops.upcast(low)]

    low, high = run_fn(program, x)
    assert low.dtype == BF16 and high.dtype == np.float32
    np.testing.assert_array_equal(high, x.astype(BF16).astype(np.float32))
