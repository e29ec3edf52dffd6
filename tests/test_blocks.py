"""The decoder pieces (decoders/blocks/) against numpy and torch references.

Every piece is written into a small program the way the program builder does it: its declared
parameters read from a fake checkpoint in HF's layout (`read`), arranged by the lowering, and
bound by their program names; the references use the checkpoint tensors directly.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hlo_run import run_fn
from hypothesis import given, settings
from hypothesis import strategies as st

from decoders.blocks import MLP, Alibi, Attention, DecoderLayer, Embedding, Head, Norm, Rotary
from decoders.blocks.params import Kind, Param, Shard, Source, per_head_qkv, read, rows
from decoders.blocks.step import Step
from decoders.blocks.values import PieceValues
from decoders.checkpoints.base import Checkpoint, is_float_dtype
from decoders.lowering import XlaLowering
from pyhlo.ops import nn

SETTINGS = settings(max_examples=8, deadline=None)
seeds = st.integers(0, 2**32 - 1)
IN_OUT, OUT_IN = XlaLowering("f32", "in_out"), XlaLowering("f32", "out_in")
LOWERINGS = pytest.mark.parametrize("lowering", [IN_OUT, OUT_IN], ids=["in_out", "out_in"])
TOL = dict(rtol=1e-5, atol=1e-5)
F32_LOWEST = np.finfo(np.float32).min


class FakeCheckpoint:
    """What `read` needs of a checkpoint: `get(name)`, `rows(names)` (Checkpoint's, over get) and `in`."""

    rows = Checkpoint.rows

    def __init__(self, tensors: dict[str, np.ndarray]):
        self.tensors = tensors
        self.read: list[str] = []

    def get(self, name: str, keep_dtype: bool = False) -> np.ndarray:
        self.read.append(name)
        array = self.tensors[name]
        return array if keep_dtype or not is_float_dtype(array.dtype) else array.astype(np.float32)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors


def _randn(rng, *dims, scale=1.0):
    return (rng.standard_normal(dims) * scale).astype(np.float32)


def _weights(params: list[Param], checkpoint: FakeCheckpoint, lowering, layer: int | None = 0):
    """Program arrays of `params`, read from the checkpoint and arranged as the lowering wants."""
    arrays = {}
    for param in params:
        array = lowering.arrange(param, read(param, checkpoint, layer))
        assert array.shape == lowering.param_dims(param), param.name
        arrays[param.name] = array
    return arrays


def _run(inputs: dict[str, np.ndarray], body) -> list[np.ndarray]:
    """Run body(values) (a list of HloValues) with every input a named program parameter."""
    names = list(inputs)
    dtypes = {np.dtype(np.float32): "f32", np.dtype(np.int32): "s32"}

    def program(scribe):
        values = {name: getattr(scribe, dtypes[inputs[name].dtype])[inputs[name].shape].Parameter(
            parameter_number=i, parameter_name=name) for i, name in enumerate(names)}
        return body(values)

    return run_fn(program, *(inputs[name] for name in names))


def _linear(x, weight, bias=None):
    """x @ weight.T (+ bias) in float64, weight torch-like [out, in]."""
    out = x.astype(np.float64) @ weight.astype(np.float64).T
    return out if bias is None else out + bias


# -- references -------------------------------------------------------------------------

def ref_norm(x, weight, bias, kind, eps, weight_offset=0.0):
    if kind == "rms":
        x = x.astype(np.float64)
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (weight_offset + weight)
    t = F.layer_norm(torch.from_numpy(x.astype(np.float64)), (x.shape[-1],),
                     torch.from_numpy(weight.astype(np.float64)),
                     None if bias is None else torch.from_numpy(bias.astype(np.float64)), eps)
    return t.numpy()


ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
               "relu": F.relu}


def ref_mlp(x, t: dict[str, np.ndarray], activation, gated, bias):
    act = ACTIVATIONS[activation]
    b = (lambda name: t[name + ".bias"]) if bias else (lambda name: None)
    if gated:
        inner = (act(torch.from_numpy(_linear(x, t["gate.weight"], b("gate")))).numpy()
                 * _linear(x, t["up.weight"], b("up")))
    else:
        inner = act(torch.from_numpy(_linear(x, t["up.weight"], b("up")))).numpy()
    return _linear(inner, t["down.weight"], b("down"))


def ref_rotary(x, positions, inv_freq, style):
    """x [b, n, heads, d]: HF's rotate_half ("half") or GPT-J's pairs ("interleaved") on the
    first 2 * len(inv_freq) features."""
    rd = 2 * len(inv_freq)
    x = x.astype(np.float64)
    rot, rest = x[..., :rd], x[..., rd:]
    angles = positions[..., None].astype(np.float64) * np.asarray(inv_freq, np.float64)   # [b, n, rd/2]
    if style == "half":
        angles = np.concatenate([angles, angles], -1)
        rotated = np.concatenate([-rot[..., rd // 2:], rot[..., :rd // 2]], -1)
    else:
        angles = np.repeat(angles, 2, -1)
        rotated = np.stack([-rot[..., 1::2], rot[..., 0::2]], -1).reshape(rot.shape)
    cos, sin = np.cos(angles)[:, :, None], np.sin(angles)[:, :, None]
    return np.concatenate([rot * cos + rotated * sin, rest], -1)


def ref_attention(att: Attention, t: dict[str, np.ndarray], x, positions, slot, pad, cache_k, cache_v,
                  n_attend):
    """(output, cache_k, cache_v) in float64 from the q/k/v/out tensors in HF's layout.

    Line i's query j sits at slot + j and sees key slots pad[i] <= s <= slot + j (and
    slot + j - s < window); ALiBi adds slope[h] * (s - pad[i]).
    """
    b, n, _ = x.shape
    h, kvh, d = att.n_heads, att.n_kv_heads, att.head_dim

    def bias(part):
        return t.get(f"{part}.bias")

    q = _linear(x, t["q.weight"], bias("q")).reshape(b, n, h, d)
    k = _linear(x, t["k.weight"], bias("k")).reshape(b, n, kvh, d)
    v = _linear(x, t["v.weight"], bias("v")).reshape(b, n, kvh, d)
    if att.q_norm is not None:
        q = ref_norm(q, t["q_norm.weight"], None, "rms", att.q_norm.eps, att.q_norm.weight_offset)
    if att.k_norm is not None:
        k = ref_norm(k, t["k_norm.weight"], None, "rms", att.k_norm.eps, att.k_norm.weight_offset)
    if isinstance(att.positions, Rotary):
        q = ref_rotary(q, positions, att.positions.inv_freq, att.positions.style)
        k = ref_rotary(k, positions, att.positions.inv_freq, att.positions.style)
    cache_k, cache_v = cache_k.astype(np.float64), cache_v.astype(np.float64)
    cache_k[:, :, slot:slot + n] = k.transpose(0, 2, 1, 3)
    cache_v[:, :, slot:slot + n] = v.transpose(0, 2, 1, 3)
    keys = np.repeat(cache_k[:, :, :n_attend], h // kvh, axis=1)          # [b, h, s, d]
    vals = np.repeat(cache_v[:, :, :n_attend], h // kvh, axis=1)
    scores = np.einsum("bnhd,bhsd->bhns", q, keys) / np.sqrt(d)
    key_slot = np.arange(n_attend)[None, None, :]
    query_slot = slot + np.arange(n)[None, :, None]
    visible = (key_slot >= pad[:, None, None]) & (key_slot <= query_slot)
    if att.window is not None:
        visible &= query_slot - key_slot < att.window
    if isinstance(att.positions, Alibi):
        slopes = nn.alibi_slopes(h).astype(np.float64)
        scores = scores + slopes[None, :, None, None] * (key_slot[None] - pad[:, None, None, None])
    scores = np.where(visible[:, None], scores, -1e30)   # a padding query sees nothing: not compared
    e = np.exp(scores - scores.max(-1, keepdims=True))
    context = np.einsum("bhns,bhsd->bnhd", e / e.sum(-1, keepdims=True), vals).reshape(b, n, h * d)
    return _linear(context, t["out.weight"], bias("out")), cache_k, cache_v


# -- Norm ---------------------------------------------------------------------------------

@SETTINGS
@given(lead=st.lists(st.integers(1, 3), min_size=1, max_size=2), width=st.integers(2, 12),
       kind_bias=st.sampled_from([("rms", False), ("layer", False), ("layer", True)]), seed=seeds)
def test_norm(lead, width, kind_bias, seed):
    kind, bias = kind_bias
    rng = np.random.default_rng(seed)
    norm = Norm("model.layers.{i}.ln", width=width, kind=kind, bias=bias, eps=1e-5)
    params = norm.params("ln")
    assert [p.name for p in params] == ["ln.weight", "ln.bias"][:1 + bias]
    assert all(p.kind is Kind.VECTOR and p.shard is Shard.REPLICATED for p in params)
    tensors = {"model.layers.3.ln.weight": _randn(rng, width) + 1,
               "model.layers.3.ln.bias": _randn(rng, width)}
    x = _randn(rng, *lead, width, scale=3.0) + 2.0   # an offset a layer norm must remove
    weights = _weights(params, FakeCheckpoint(tensors), IN_OUT, layer=3)
    (out,) = _run({"x": x, **weights}, lambda v: [norm(PieceValues(v, IN_OUT, "ln", params), v["x"])])
    expected = ref_norm(x, tensors["model.layers.3.ln.weight"],
                        tensors["model.layers.3.ln.bias"] if bias else None, kind, 1e-5)
    # The variance of an f32 sum of squares over `width` features: a few ulps.
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=2e-5)


def test_rms_norm_with_gemmas_weight_offset_scales_by_one_plus_weight():
    rng = np.random.default_rng(11)
    norm = Norm("model.norm", width=8, eps=1e-6, weight_offset=1.0)
    params = norm.params("ln")
    weight = _randn(rng, 8, scale=0.1)          # Gemma's weights sit near 0: the scale near 1
    x = _randn(rng, 2, 3, 8, scale=2.0)
    weights = _weights(params, FakeCheckpoint({"model.norm.weight": weight}), IN_OUT, layer=None)
    (out,) = _run({"x": x, **weights}, lambda v: [norm(PieceValues(v, IN_OUT, "ln", params), v["x"])])
    torch_x = torch.from_numpy(x.astype(np.float64))
    expected = torch_x * torch.rsqrt(torch_x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + torch.from_numpy(
        weight.astype(np.float64)))
    np.testing.assert_allclose(out, expected.numpy(), rtol=1e-5, atol=1e-5)


def test_norm_rejects_bad_settings():
    with pytest.raises(ValueError, match="'rms' or 'layer'"):
        Norm("n", 4, kind="batch")
    with pytest.raises(ValueError, match="no bias"):
        Norm("n", 4, kind="rms", bias=True)
    with pytest.raises(ValueError, match="weight_offset is for RMS norms"):
        Norm("n", 4, kind="layer", weight_offset=1.0)


# -- MLP ------------------------------------------------------------------------------------

MLP_CASES = [("silu", True, False), ("silu", True, True), ("gelu", False, True), ("gelu_tanh", False, False),
             ("relu", False, True), ("gelu_tanh", True, True)]


@pytest.mark.parametrize("activation, gated, bias", MLP_CASES)
@LOWERINGS
def test_mlp(activation, gated, bias, lowering):
    hidden, inter = 6, 10
    rng = np.random.default_rng(MLP_CASES.index((activation, gated, bias)))
    prefix = "model.layers.{i}.mlp"
    mlp = MLP(up=f"{prefix}.up_proj", down=f"{prefix}.down_proj", hidden=hidden, intermediate=inter,
              gate=f"{prefix}.gate_proj" if gated else None, activation=activation, bias=bias)
    tensors = {"up.weight": _randn(rng, inter, hidden), "up.bias": _randn(rng, inter),
               "gate.weight": _randn(rng, inter, hidden), "gate.bias": _randn(rng, inter),
               "down.weight": _randn(rng, hidden, inter), "down.bias": _randn(rng, hidden)}
    checkpoint = FakeCheckpoint({f"model.layers.0.mlp.{name.split('.')[0]}_proj.{name.split('.')[1]}": a
                                 for name, a in tensors.items()})
    params = mlp.params("mlp")
    x = _randn(rng, 2, 3, hidden)
    weights = _weights(params, checkpoint, lowering)
    (out,) = _run({"x": x, **weights}, lambda v: [mlp(PieceValues(v, lowering, "mlp", params), v["x"])])
    np.testing.assert_allclose(out, ref_mlp(x, tensors, activation, gated, bias), **TOL)


@LOWERINGS
def test_mlp_with_one_fused_gate_up_projection_as_phi3(lowering):
    hidden, inter = 6, 10
    rng = np.random.default_rng(20)
    tensors = {"gate.weight": _randn(rng, inter, hidden), "up.weight": _randn(rng, inter, hidden),
               "down.weight": _randn(rng, hidden, inter)}
    mlp = MLP(up="mlp.gate_up_proj", down="mlp.down_proj", hidden=hidden, intermediate=inter,
              gate_up_fused=True)
    checkpoint = FakeCheckpoint({"mlp.gate_up_proj.weight": np.concatenate([tensors["gate.weight"],
                                                                            tensors["up.weight"]]),
                                 "mlp.down_proj.weight": tensors["down.weight"]})
    params = mlp.params("mlp")
    assert [(p.name, p.source.names, p.segments) for p in params][0] == (
        "mlp.gate_up.weight", ("mlp.gate_up_proj.weight",), (inter, inter))
    x = _randn(rng, 2, 3, hidden)
    weights = _weights(params, checkpoint, lowering)
    (out,) = _run({"x": x, **weights}, lambda v: [mlp(PieceValues(v, lowering, "mlp", params), v["x"])])
    np.testing.assert_allclose(out, ref_mlp(x, tensors, "silu", True, False), **TOL)
    with pytest.raises(ValueError, match="named by `up` alone"):
        MLP(up="u", down="d", hidden=4, intermediate=6, gate="g", gate_up_fused=True)


@pytest.mark.parametrize("gated", [True, False])
def test_mlp_params(gated):
    mlp = MLP(up="u", down="d", hidden=4, intermediate=6, gate="g" if gated else None, bias=True)
    params = {p.name: p for p in mlp.params("mlp")}
    first = "mlp.gate_up" if gated else "mlp.up"
    assert list(params) == [f"{first}.weight", f"{first}.bias", "mlp.down.weight", "mlp.down.bias"]
    width = 12 if gated else 6
    assert params[f"{first}.weight"].shape == (width, 4) and params[f"{first}.weight"].kind is Kind.LINEAR
    assert params[f"{first}.bias"].shape == (width,) and params[f"{first}.bias"].kind is Kind.VECTOR
    for name in (f"{first}.weight", f"{first}.bias"):
        assert params[name].shard is Shard.COLUMN
        assert params[name].segments == ((6, 6) if gated else ())
    if gated:
        assert params["mlp.gate_up.weight"].source.names == ("g.weight", "u.weight")
    assert params["mlp.down.weight"].shape == (4, 6) and params["mlp.down.weight"].shard is Shard.ROW
    assert params["mlp.down.bias"].shape == (4,) and params["mlp.down.bias"].shard is Shard.REPLICATED
    with pytest.raises(ValueError, match="unknown activation"):
        MLP(up="u", down="d", hidden=4, intermediate=6, activation="swiglu")


# -- parameters: per-head qkv, rows, read ------------------------------------------------------

@SETTINGS
@given(heads=st.integers(1, 4), head_dim=st.integers(1, 4), hidden=st.integers(1, 5), seed=seeds)
def test_per_head_qkv_and_rows_split_like_hf(heads, head_dim, hidden, seed):
    rng = np.random.default_rng(seed)
    fused = _randn(rng, heads * 3 * head_dim, hidden)
    fused_bias = _randn(rng, heads * 3 * head_dim)
    size = heads * head_dim
    for array, trailing in ((fused, (hidden,)), (fused_bias, ())):
        qkv = per_head_qkv(heads, head_dim)(array)
        assert qkv.shape == array.shape
        # GPT-NeoX: qkv.view(..., heads, 3 * head_dim) then split; Bloom: view(heads, 3, head_dim).
        per_head = torch.from_numpy(array).view(heads, 3, head_dim, *trailing)
        for part in range(3):
            expected = per_head[:, part].reshape(size, *trailing).numpy()
            np.testing.assert_array_equal(rows(part * size, (part + 1) * size)(qkv), expected)


def test_read_concatenates_picks_alternatives_and_strips_the_base_prefix():
    rng = np.random.default_rng(0)
    gate, up = _randn(rng, 3, 2), _randn(rng, 4, 2)
    checkpoint = FakeCheckpoint({"model.layers.1.gate.weight": gate, "model.layers.1.up.weight": up})
    param = Param("mlp.gate_up.weight", Kind.LINEAR, (7, 2), Shard.COLUMN,
                  Source(("model.layers.{i}.gate.weight", "model.layers.{i}.up.weight")), segments=(3, 4))
    np.testing.assert_array_equal(read(param, checkpoint, 1), np.concatenate([gate, up]))
    assert checkpoint.read == ["model.layers.1.gate.weight", "model.layers.1.up.weight"]

    # Alternatives: the first present wins.
    head, out = _randn(rng, 5, 2), _randn(rng, 5, 2)
    param = Param("lm_head.weight", Kind.LINEAR, (5, 2), Shard.VOCAB,
                  Source((("lm_head.weight", "embed_out.weight"),)), is_head=True)
    np.testing.assert_array_equal(read(param, FakeCheckpoint({"embed_out.weight": out}), None), out)
    np.testing.assert_array_equal(read(param, FakeCheckpoint({"embed_out.weight": out,
                                                              "lm_head.weight": head}),
                                       None), head)

    # A base model's checkpoint lacks the "transformer." prefix.
    ln = _randn(rng, 2)
    param = Param("ln.weight", Kind.VECTOR, (2,), Shard.REPLICATED, Source(("transformer.h.{i}.ln.weight",)))
    checkpoint = FakeCheckpoint({"h.0.ln.weight": ln})
    np.testing.assert_array_equal(read(param, checkpoint, 0), ln)
    assert checkpoint.read == ["h.0.ln.weight"]
    # ... and the full name wins when both are there.
    full = ln + 1
    np.testing.assert_array_equal(read(param, FakeCheckpoint({"h.0.ln.weight": ln,
                                                              "transformer.h.0.ln.weight": full}), 0), full)

    # Transforms apply in order after the concatenation.
    param = Param("t", Kind.LINEAR, (2, 3), Shard.COLUMN, Source(("a", "b"), (lambda a: a.T, rows(0, 2))))
    a, b = _randn(rng, 1, 3), _randn(rng, 2, 3)
    np.testing.assert_array_equal(read(param, FakeCheckpoint({"a": a, "b": b}), None),
                                  np.concatenate([a, b]).T[0:2])


def test_read_keeps_f32_f16_and_bf16_as_stored_and_widens_the_rest():
    rng = np.random.default_rng(0)
    w = _randn(rng, 4, 2)
    param = Param("w", Kind.LINEAR, (4, 2), Shard.COLUMN, Source(("w",)))
    for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
        got = read(param, FakeCheckpoint({"w": w.astype(dtype)}), None)
        assert got.dtype == np.dtype(dtype)                      # placed as stored, converted once
        np.testing.assert_array_equal(got, w.astype(dtype))
    # fp8, parts of different types, a weight quantized to int8 at load: f32, exactly the stored values.
    fp8 = w.astype(ml_dtypes.float8_e4m3fn)
    got = read(param, FakeCheckpoint({"w": fp8}), None)
    assert got.dtype == np.float32 and np.array_equal(got, fp8.astype(np.float32))
    fused = Param("gate_up", Kind.LINEAR, (4, 2), Shard.COLUMN, Source(("a", "b")), segments=(2, 2))
    a, b = w[:2].astype(ml_dtypes.bfloat16), w[2:].astype(np.float16)
    got = read(fused, FakeCheckpoint({"a": a, "b": b}), None)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, np.concatenate([a.astype(np.float32), b.astype(np.float32)]))
    quantized = Param("w", Kind.LINEAR, (4, 2), Shard.COLUMN, Source(("w",)), quant="s8")
    got = read(quantized, FakeCheckpoint({"w": w.astype(ml_dtypes.bfloat16)}), None)
    assert got.dtype == np.float32


def test_read_reports_a_wrong_shape():
    param = Param("attn.out.weight", Kind.LINEAR, (4, 6), Shard.ROW,
                  Source(("model.layers.{i}.o_proj.weight",)))
    checkpoint = FakeCheckpoint({"model.layers.2.o_proj.weight": np.zeros((6, 4), np.float32)})
    with pytest.raises(ValueError, match=r"attn\.out\.weight: model\.layers\.2\.o_proj\.weight gives shape "
                                         r"\(6, 4\), expected \(4, 6\)"):
        read(param, checkpoint, 2)


def test_param_segments_must_add_up():
    with pytest.raises(ValueError, match=r"attn.qkv.weight: segments \(4, 2, 1\) do not add up to 8"):
        Param("attn.qkv.weight", Kind.LINEAR, (8, 4), Shard.COLUMN, Source(("w",)), segments=(4, 2, 1))
    Param("attn.qkv.weight", Kind.LINEAR, (8, 4), Shard.COLUMN, Source(("w",)), segments=(4, 2, 2))


# -- Attention --------------------------------------------------------------------------------

def _inv_freq(rotary_dim, base=100.0):
    return tuple(float(f) for f in 1.0 / base ** (np.arange(0, rotary_dim, 2) / rotary_dim))


def _split_attention(**kwargs) -> Attention:
    p = "model.layers.{i}.self_attn"
    return Attention(out=f"{p}.o_proj", q=f"{p}.q_proj", k=f"{p}.k_proj", v=f"{p}.v_proj", **kwargs)


def _fused_attention(**kwargs) -> Attention:
    p = "gpt_neox.layers.{i}.attention"
    return Attention(out=f"{p}.dense", qkv=f"{p}.query_key_value", **kwargs)


def _attention_checkpoint(att: Attention, rng) -> tuple[dict[str, np.ndarray], FakeCheckpoint]:
    """Random q/k/v/out tensors in HF's layout, and a checkpoint holding them as `att` names them
    (a fused per-head or contiguous qkv built from q, k and v for a `qkv` attention)."""
    hidden, q_size, kv_size = att.hidden, att.q_size, att.kv_size
    t = {"q.weight": _randn(rng, q_size, hidden, scale=0.5),
         "k.weight": _randn(rng, kv_size, hidden, scale=0.5),
         "v.weight": _randn(rng, kv_size, hidden), "out.weight": _randn(rng, hidden, q_size, scale=0.5)}
    if att.qkv_bias:
        t.update({"q.bias": _randn(rng, q_size), "k.bias": _randn(rng, kv_size),
                  "v.bias": _randn(rng, kv_size)})
    if att.out_bias:
        t["out.bias"] = _randn(rng, hidden)
    stored = {}
    suffixes = ("weight", "bias") if att.qkv_bias else ("weight",)
    if att.qkv is None:
        for part in ("q", "k", "v"):
            for suffix in suffixes:
                stored[f"{getattr(att, part).format(i=0)}.{suffix}"] = t[f"{part}.{suffix}"]
    elif att.qkv_layout == "contiguous":
        for suffix in suffixes:
            # GPT-2's c_attn: [q | k | v] along `out`.
            stored[f"{att.qkv.format(i=0)}.{suffix}"] = np.concatenate([t[f"{part}.{suffix}"]
                                                                       for part in "qkv"])
    else:
        for suffix in suffixes:
            # GPT-NeoX's query_key_value: [heads, (q, k, v), head_dim] along `out`.
            parts = [t[f"{part}.{suffix}"].reshape(att.n_heads, 1, att.head_dim, -1)
                     for part in ("q", "k", "v")]
            stored[f"{att.qkv.format(i=0)}.{suffix}"] = np.concatenate(parts, 1).reshape(
                3 * q_size, *t[f"q.{suffix}"].shape[1:])
    for name in ("q_norm", "k_norm"):
        if getattr(att, name) is not None:
            t[f"{name}.weight"] = _randn(rng, att.head_dim, scale=0.5) + 1
            stored[f"{getattr(att, name).checkpoint.format(i=0)}.weight"] = t[f"{name}.weight"]
    stored[f"{att.out.format(i=0)}.weight"] = t["out.weight"]
    if att.out_bias:
        stored[f"{att.out.format(i=0)}.bias"] = t["out.bias"]
    if att.stored_in_out:
        # GPT-2's Conv1D keeps weights [in, out].
        stored = {name: a.T.copy() if name.endswith(".weight") else a for name, a in stored.items()}
    return t, FakeCheckpoint(stored)


def _step_inputs(n, slot, pad):
    """positions s32[b, n] (slot - pad, 0 on padding), slot s32[], pad s32[b]."""
    pad = np.asarray(pad, np.int32)
    positions = np.maximum(slot + np.arange(n)[None, :] - pad[:, None], 0).astype(np.int32)
    return {"positions": positions, "slot": np.array(slot, np.int32), "pad": pad}


def _run_attention(att: Attention, lowering, weights, x, step, cache_k, cache_v, n_attend):
    params = att.params("attn")

    def body(v):
        s = Step(v["positions"], v["slot"], v["pad"], x.shape[1], n_attend)
        return list(att(PieceValues(v, lowering, "attn", params), v["x"], s, v["cache_k"], v["cache_v"]))

    return _run({"x": x, **step, "cache_k": cache_k, "cache_v": cache_v, **weights}, body)


def _check_attention(att: Attention, lowering, seed, prefill=5, pad=(0, 2), cache_len=9, n_attend=(6, 7)):
    """Prefill `prefill` tokens at slot 0 over a cache holding stale values, then decode one at
    slot `prefill` from the caches the prefill returned; both against `ref_attention`."""
    rng = np.random.default_rng(seed)
    t, checkpoint = _attention_checkpoint(att, rng)
    weights = _weights(att.params("attn"), checkpoint, lowering)
    b, pad = len(pad), np.asarray(pad, np.int32)
    dims = (b, att.n_kv_heads, cache_len, att.head_dim)
    cache_k, cache_v = _randn(rng, *dims), _randn(rng, *dims)   # stale: every unwritten slot must stay unseen
    for slot, n, attend in ((0, prefill, n_attend[0]), (prefill, 1, n_attend[1])):
        x = _randn(rng, b, n, att.hidden)
        step = _step_inputs(n, slot, pad)
        out, new_k, new_v = _run_attention(att, lowering, weights, x, step, cache_k, cache_v, attend)
        expected, ref_k, ref_v = ref_attention(att, t, x, step["positions"], slot, pad, cache_k, cache_v,
                                               attend)
        assert out.shape == (b, n, att.hidden) and new_k.shape == dims and new_v.shape == dims
        assert np.isfinite(out).all()
        # Only real tokens: a padding query sees no key, and its output is of no use.
        real = slot + np.arange(n)[None, :] >= pad[:, None]
        np.testing.assert_allclose(out[real], expected[real], **TOL)
        # The new keys and values at slot .. slot + n - 1; every other slot as it was.
        np.testing.assert_allclose(new_k, ref_k, **TOL)
        np.testing.assert_allclose(new_v, ref_v, **TOL)
        untouched = np.ones(cache_len, bool)
        untouched[slot:slot + n] = False
        np.testing.assert_array_equal(new_k[:, :, untouched], cache_k[:, :, untouched])
        np.testing.assert_array_equal(new_v[:, :, untouched], cache_v[:, :, untouched])
        cache_k, cache_v = new_k, new_v
    return t, checkpoint


@LOWERINGS
def test_attention_grouped_query_rotary_half(lowering):
    att = _split_attention(hidden=8, n_heads=4, n_kv_heads=2, head_dim=4, positions=Rotary(_inv_freq(4)))
    _check_attention(att, lowering, seed=1)


def test_attention_split_unfused_with_biases():
    att = _split_attention(hidden=8, n_heads=4, n_kv_heads=2, head_dim=4, positions=Rotary(_inv_freq(4)),
                           qkv_bias=True, out_bias=True, fused=False)
    _check_attention(att, IN_OUT, seed=2, pad=(1, 0, 3))


@pytest.mark.parametrize("fused", [True, False])
@LOWERINGS
def test_attention_fused_per_head_qkv_partial_rotary(fused, lowering):
    # GPT-NeoX: a fused per-head query_key_value with biases, rotary on 4 of 6 features.
    att = _fused_attention(hidden=12, n_heads=2, n_kv_heads=2, head_dim=6, positions=Rotary(_inv_freq(4)),
                           qkv_bias=True, out_bias=True, fused=fused)
    _check_attention(att, lowering, seed=3)


def test_attention_fused_and_split_qkv_programs_agree():
    kwargs = dict(hidden=12, n_heads=2, n_kv_heads=2, head_dim=6, positions=Rotary(_inv_freq(4)),
                  qkv_bias=True, out_bias=True)
    rng = np.random.default_rng(4)
    att = _fused_attention(**kwargs)
    _, checkpoint = _attention_checkpoint(att, rng)
    x = _randn(rng, 2, 3, 12)
    step = _step_inputs(3, 0, (0, 1))
    cache = np.zeros((2, 2, 4, 6), np.float32)
    outs = []
    for fused in (True, False):
        piece = _fused_attention(fused=fused, **kwargs)
        names = [p.name for p in piece.params("attn")]
        assert ("attn.qkv.weight" in names) == fused and ("attn.q.weight" in names) != fused
        weights = _weights(piece.params("attn"), checkpoint, IN_OUT)
        outs.append(_run_attention(piece, IN_OUT, weights, x, step, cache, cache, 3))
    # One product or three: the same sums, added in another order on a GPU.
    for fused_out, split_out in zip(*outs):
        np.testing.assert_allclose(fused_out, split_out, rtol=1e-5, atol=1e-5)


def _head_norms(weight_offset: float) -> dict[str, Norm]:
    p = "model.layers.{i}.self_attn"
    return {"q_norm": Norm(f"{p}.q_norm", 4, eps=1e-6, weight_offset=weight_offset),
            "k_norm": Norm(f"{p}.k_norm", 4, eps=1e-6, weight_offset=weight_offset)}


@pytest.mark.parametrize("weight_offset", [0.0, 1.0], ids=["qwen3", "gemma3"])
@pytest.mark.parametrize("fused", [True, False])
def test_attention_per_head_q_and_k_norms_before_rotary(weight_offset, fused):
    # Qwen3 (plain weight) and Gemma 3 (1 + weight): each head's queries and keys normed.
    att = _split_attention(hidden=8, n_heads=4, n_kv_heads=2, head_dim=4, positions=Rotary(_inv_freq(4)),
                           fused=fused, **_head_norms(weight_offset))
    params = {p.name: p for p in att.params("attn")}
    for name in ("q_norm", "k_norm"):
        norm = params[f"attn.{name}.weight"]
        assert norm.shape == (4,) and norm.shard is Shard.REPLICATED
        assert norm.source.names == (f"model.layers.{{i}}.self_attn.{name}.weight",)
    _check_attention(att, IN_OUT, seed=12, pad=(0, 3))


def test_attention_rotary_interleaved():
    # GPT-J: pairs (2i, 2i + 1), partial.
    att = _split_attention(hidden=8, n_heads=2, n_kv_heads=2, head_dim=4, out_bias=True,
                           positions=Rotary(_inv_freq(2), style="interleaved"))
    _check_attention(att, OUT_IN, seed=5)
    att = _split_attention(hidden=8, n_heads=2, n_kv_heads=1, head_dim=4,
                           positions=Rotary(_inv_freq(4), style="interleaved"))
    _check_attention(att, IN_OUT, seed=6)


@LOWERINGS
def test_attention_alibi(lowering):
    # Bloom: a fused per-head qkv with biases, no rotary; 3 heads exercise the extra slopes.
    att = _fused_attention(hidden=9, n_heads=3, n_kv_heads=3, head_dim=3, positions=Alibi(), qkv_bias=True,
                           out_bias=True)
    _check_attention(att, lowering, seed=7, pad=(0, 3))


def test_attention_alibi_bias_depends_on_the_key_slot():
    """Keys alike but for their slot: ALiBi alone tells them apart, so a wrong slope or slot
    sign moves the output (a shift by the same amount for every key would not)."""
    att = _split_attention(hidden=4, n_heads=2, n_kv_heads=2, head_dim=2, positions=Alibi())
    t = {"q.weight": np.zeros((4, 4), np.float32), "k.weight": np.zeros((4, 4), np.float32),
         "v.weight": np.eye(4, dtype=np.float32), "out.weight": np.eye(4, dtype=np.float32)}
    checkpoint = FakeCheckpoint({f"model.layers.0.self_attn.{n}_proj.weight": t[f"{n}.weight"] for n in "qkv"}
                                | {"model.layers.0.self_attn.o_proj.weight": t["out.weight"]})
    weights = _weights(att.params("attn"), checkpoint, IN_OUT)
    rng = np.random.default_rng(8)
    x = _randn(rng, 1, 4, 4)
    step = _step_inputs(4, 0, (1,))
    cache = np.zeros((1, 2, 4, 2), np.float32)
    out, _, _ = _run_attention(att, IN_OUT, weights, x, step, cache, cache, 4)
    expected, _, _ = ref_attention(att, t, x, step["positions"], 0, np.array([1]), cache, cache, 4)
    np.testing.assert_allclose(out[0, 1:], expected[0, 1:], **TOL)
    # The last query: weights exp(slope * (s - 1)) over keys 1..3.
    slopes = nn.alibi_slopes(2).astype(np.float64)
    w = np.exp(slopes[:, None] * np.arange(3))
    w /= w.sum(-1, keepdims=True)
    np.testing.assert_allclose(out[0, 3].reshape(2, 2), np.einsum("hs,shd->hd", w, x[0, 1:].reshape(3, 2, 2)),
                               **TOL)


@pytest.mark.parametrize("window", [1, 3])
def test_attention_sliding_window(window):
    att = _split_attention(hidden=8, n_heads=4, n_kv_heads=2, head_dim=4, positions=Rotary(_inv_freq(4)),
                           window=window)
    _check_attention(att, IN_OUT, seed=9 + window, prefill=6, n_attend=(7, 8))


def test_attention_params():
    att = _split_attention(hidden=8, n_heads=4, n_kv_heads=2, head_dim=4, qkv_bias=True, out_bias=True)
    params = {p.name: p for p in att.params("attn")}
    assert list(params) == ["attn.qkv.weight", "attn.qkv.bias", "attn.out.weight", "attn.out.bias"]
    qkv = params["attn.qkv.weight"]
    assert qkv.shape == (32, 8) and qkv.kind is Kind.LINEAR and qkv.shard is Shard.COLUMN
    assert qkv.segments == (16, 8, 8) == (att.q_size, att.kv_size, att.kv_size)
    assert qkv.source.names == tuple(f"model.layers.{{i}}.self_attn.{n}_proj.weight" for n in "qkv")
    assert params["attn.qkv.bias"].shape == (32,) and params["attn.qkv.bias"].segments == (16, 8, 8)
    assert params["attn.qkv.bias"].shard is Shard.COLUMN
    out = params["attn.out.weight"]
    assert out.shape == (8, 16) and out.shard is Shard.ROW
    assert params["attn.out.bias"].shard is Shard.REPLICATED
    split = {p.name: p for p in _split_attention(hidden=8, n_heads=4, n_kv_heads=2, head_dim=4,
                                                 fused=False).params("attn")}
    assert list(split) == ["attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.out.weight"]
    assert [split[f"attn.{n}.weight"].shape for n in "qkv"] == [(16, 8), (8, 8), (8, 8)]
    assert all(split[f"attn.{n}.weight"].shard is Shard.COLUMN for n in "qkv")


def test_attention_rejects_bad_settings():
    with pytest.raises(ValueError, match="either q, k and v, or qkv"):
        Attention(out="o", hidden=4, n_heads=2, n_kv_heads=2, head_dim=2, q="q", k="k")
    with pytest.raises(ValueError, match="not a multiple"):
        _split_attention(hidden=4, n_heads=3, n_kv_heads=2, head_dim=2)
    with pytest.raises(ValueError, match="as many kv heads as heads"):
        _fused_attention(hidden=4, n_heads=4, n_kv_heads=2, head_dim=2)
    with pytest.raises(ValueError, match="rotary dimension 6"):
        _split_attention(hidden=4, n_heads=2, n_kv_heads=2, head_dim=4, positions=Rotary(_inv_freq(6)))
    with pytest.raises(ValueError, match="per-head q or k norm has width head_dim 4, got 8"):
        _split_attention(hidden=8, n_heads=2, n_kv_heads=2, head_dim=4, k_norm=Norm("k_norm", 8))


# -- Embedding and Head -------------------------------------------------------------------------

def _run_embedding(emb: Embedding, lowering, inputs, table_name, include_tokens=True):
    params = emb.params(include_tokens=include_tokens)

    def body(v):
        values = PieceValues(v, lowering, "embed", params)
        return [emb(values, v[table_name], v["ids"], v.get("positions"), "f32")]

    return _run(inputs, body)[0]


def test_embedding_token_rows():
    rng = np.random.default_rng(10)
    tokens = _randn(rng, 11, 6)
    emb = Embedding("model.embed_tokens.weight", vocab_size=11, hidden=6)
    weights = _weights(emb.params(), FakeCheckpoint({"model.embed_tokens.weight": tokens}), IN_OUT, None)
    ids = rng.integers(0, 11, (3, 4)).astype(np.int32)
    out = _run_embedding(emb, IN_OUT, {"ids": ids, **weights}, "embed.tokens")
    np.testing.assert_array_equal(out, tokens[ids])


def test_embedding_learned_positions_with_offset_and_norm():
    # OPT's offset of 2, Bloom's embedding layer norm (both, to see their order).
    rng = np.random.default_rng(11)
    vocab, hidden, n_positions = 13, 6, 10
    t = {"tok": _randn(rng, vocab, hidden), "pos": _randn(rng, n_positions, hidden),
         "ln.weight": _randn(rng, hidden) + 1, "ln.bias": _randn(rng, hidden)}
    emb = Embedding("tok", vocab, hidden, positions="pos", n_positions=n_positions, position_offset=2,
                    norm=Norm("ln", hidden, kind="layer", bias=True, eps=1e-5))
    params = emb.params()
    assert [p.name for p in params] == ["embed.tokens", "embed.positions", "embed.norm.weight",
                                        "embed.norm.bias"]
    assert all(p.shard is Shard.REPLICATED for p in params)
    assert [p.kind for p in params[:2]] == [Kind.TABLE, Kind.TABLE]
    weights = _weights(params, FakeCheckpoint(t), IN_OUT, None)
    ids = rng.integers(0, vocab, (2, 3)).astype(np.int32)
    positions = np.array([[0, 1, 2], [5, 6, 7]], np.int32)
    out = _run_embedding(emb, IN_OUT, {"ids": ids, "positions": positions, **weights}, "embed.tokens")
    expected = ref_norm(t["tok"][ids] + t["pos"][positions + 2], t["ln.weight"], t["ln.bias"], "layer", 1e-5)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=2e-5)


def test_embedding_reads_the_lm_head_columns_as_its_table():
    """Tied embeddings stored once: the head [vocab, hidden] laid out [hidden, vocab] ("in_out")."""
    rng = np.random.default_rng(12)
    vocab, hidden = 11, 6
    table = _randn(rng, vocab, hidden)
    emb = Embedding("model.embed_tokens.weight", vocab, hidden)
    head = Head(Norm("model.norm", hidden), vocab, hidden, weight=None, tied_to="model.embed_tokens.weight")
    (head_param,) = [p for p in head.params() if p.name == "lm_head.weight"]
    checkpoint = FakeCheckpoint({"model.embed_tokens.weight": table})
    for lowering, dims, lines in ((IN_OUT, (hidden, vocab), (2, 5)), (IN_OUT, (hidden, vocab), (3, 3)),
                                  (OUT_IN, (vocab, hidden), (2, 5))):
        ids = rng.integers(0, vocab, lines).astype(np.int32)
        lm_head = lowering.arrange(head_param, read(head_param, checkpoint, None))
        assert lm_head.shape == dims
        out = _run_embedding(emb, lowering, {"ids": ids, "lm_head.weight": lm_head}, "lm_head.weight",
                             include_tokens=False)
        np.testing.assert_array_equal(out, table[ids])


def _run_head(head, params, tensors, lowering, rng, b, n_tokens, hidden):
    """The head's logits over random hidden states, each line picking another position (the
    last, the first, the middle); and the rows it should have picked."""
    weights = _weights(params, FakeCheckpoint(tensors), lowering, None)
    hidden_states = _randn(rng, b, n_tokens, hidden, scale=2.0)
    last_index = np.array([n_tokens - 1, 0, n_tokens // 2], np.int32)

    def body(v):
        return [head(PieceValues(v, lowering, "", params), v["hidden"], v["last_index"])]

    (logits,) = _run({"hidden": hidden_states, "last_index": last_index, **weights}, body)
    return logits, hidden_states[np.arange(b), last_index if n_tokens > 1 else 0]


@pytest.mark.parametrize("n_tokens", [1, 4])
@LOWERINGS
def test_head(n_tokens, lowering):
    rng = np.random.default_rng(13 + n_tokens)
    b, hidden, vocab = 3, 6, 10
    head = Head(Norm("model.norm", hidden, kind="rms", eps=1e-5), vocab, hidden, weight=("lm_head.weight",
                                                                                          "embed_out.weight"))
    t = {"model.norm.weight": _randn(rng, hidden) + 1, "embed_out.weight": _randn(rng, vocab, hidden)}
    params = head.params()
    logits, picked = _run_head(head, params, t, lowering, rng, b, n_tokens, hidden)
    normed = ref_norm(picked, t["model.norm.weight"], None, "rms", 1e-5)
    assert logits.dtype == np.float32 and logits.shape == (b, vocab)
    np.testing.assert_allclose(logits, _linear(normed, t["embed_out.weight"]), **TOL)


def test_head_params():
    head = Head(Norm("transformer.ln_f", 6, kind="layer", bias=True), 10, 6, weight=None,
                tied_to="transformer.wte.weight")
    params = {p.name: p for p in head.params()}
    assert list(params) == ["final_norm.weight", "final_norm.bias", "lm_head.weight"]
    lm_head = params["lm_head.weight"]
    assert lm_head.shard is Shard.VOCAB and lm_head.is_head and lm_head.kind is Kind.LINEAR
    assert lm_head.shape == (10, 6) and lm_head.source.names == ("transformer.wte.weight",)
    assert not any(p.is_head for name, p in params.items() if name != "lm_head.weight")
    # The head keeps its own element type.
    lowering = XlaLowering("bf16", "in_out", head_dtype="f32")
    assert (lowering.param_dtype(lm_head) == "f32"
            and lowering.param_dtype(params["final_norm.weight"]) == "bf16")


# -- DecoderLayer -------------------------------------------------------------------------------

def _layer(residual: str, shared_norm: bool) -> DecoderLayer:
    hidden = 8
    norm = Norm("gpt_neox.layers.{i}.input_layernorm", hidden, kind="layer", bias=True, eps=1e-5)
    post = None if shared_norm else Norm("gpt_neox.layers.{i}.post_attention_layernorm", hidden, kind="layer",
                                         bias=True, eps=1e-5)
    att = _fused_attention(hidden=hidden, n_heads=2, n_kv_heads=2, head_dim=4, positions=Rotary(_inv_freq(2)),
                           qkv_bias=True, out_bias=True)
    mlp = MLP(up="gpt_neox.layers.{i}.mlp.dense_h_to_4h", down="gpt_neox.layers.{i}.mlp.dense_4h_to_h",
              hidden=hidden, intermediate=12, activation="gelu", bias=True)
    return DecoderLayer(norm, att, mlp, post, residual)


def _run_layer(layer, weights, rng, x_dims, slot, pad, n_attend, cache_len=6):
    """Run `layer` (plain lowering, [in, out]) over random hidden states and caches with 2 kv
    heads of 4; returns the inputs and (hidden, cache_k, cache_v) out."""
    b, n, _ = x_dims
    x = _randn(rng, *x_dims)
    step = _step_inputs(n, slot, pad)
    cache_k, cache_v = (_randn(rng, b, 2, cache_len, 4) for _ in range(2))

    def body(v):
        s = Step(v["positions"], v["slot"], v["pad"], n, n_attend)
        return list(layer(v, IN_OUT, v["hidden"], s, v["cache_k"], v["cache_v"]))

    outputs = _run({"hidden": x, **step, "cache_k": cache_k, "cache_v": cache_v, **weights}, body)
    return x, step, cache_k, cache_v, outputs


@pytest.mark.parametrize("residual, shared_norm", [("sequential", False), ("parallel", False),
                                                   ("parallel", True)])
def test_decoder_layer(residual, shared_norm):
    layer = _layer(residual, shared_norm)
    rng = np.random.default_rng(20 + shared_norm)
    t_attn, checkpoint = _attention_checkpoint(layer.attention, rng)
    hidden, inter = 8, 12
    prefix = "gpt_neox.layers.0"
    norms = {name: (_randn(rng, hidden, scale=0.3) + 1, _randn(rng, hidden, scale=0.3))
             for name in ("input_layernorm", "post_attention_layernorm")}
    t_mlp = {"up.weight": _randn(rng, inter, hidden, scale=0.5), "up.bias": _randn(rng, inter),
             "down.weight": _randn(rng, hidden, inter, scale=0.5), "down.bias": _randn(rng, hidden)}
    checkpoint.tensors.update({f"{prefix}.{name}.{s}": a for name, (w, b) in norms.items()
                               for s, a in (("weight", w), ("bias", b))})
    checkpoint.tensors.update({f"{prefix}.mlp.dense_h_to_4h.{s}": t_mlp[f"up.{s}"]
                               for s in ("weight", "bias")})
    checkpoint.tensors.update({f"{prefix}.mlp.dense_4h_to_h.{s}": t_mlp[f"down.{s}"]
                               for s in ("weight", "bias")})
    params = layer.params()
    names = [p.name for p in params]
    assert names[:2] == ["input_norm.weight", "input_norm.bias"]
    assert ("post_norm.weight" in names) != shared_norm and len(names) == len(set(names))
    weights = _weights(params, checkpoint, IN_OUT)

    b, n, slot, n_attend = 2, 3, 2, 5
    pad = np.array([0, 3], np.int32)
    x, step, cache_k, cache_v, (out, new_k, new_v) = _run_layer(layer, weights, rng, x_dims=(b, n, hidden),
                                                                 slot=slot, pad=pad, n_attend=n_attend)

    def norm(name, h):
        return ref_norm(h, *norms[name], "layer", 1e-5)

    normed = norm("input_layernorm", x)
    attended, ref_k, ref_v = ref_attention(layer.attention, t_attn, normed, step["positions"], slot, pad,
                                           cache_k, cache_v, n_attend)
    if residual == "sequential":
        h = x + attended
        expected = h + ref_mlp(norm("post_attention_layernorm", h), t_mlp, "gelu", False, True)
    else:
        second = normed if shared_norm else norm("post_attention_layernorm", x)
        expected = x + attended + ref_mlp(second, t_mlp, "gelu", False, True)
    real = slot + np.arange(n)[None, :] >= pad[:, None]
    # Three products and two norms deep, in f32 against float64.
    np.testing.assert_allclose(out[real], expected[real], rtol=1e-5, atol=3e-5)
    np.testing.assert_allclose(new_k, ref_k, **TOL)
    np.testing.assert_allclose(new_v, ref_v, **TOL)


def test_decoder_layer_rejects_a_sequential_layer_without_post_norm():
    layer = _layer("parallel", True)
    with pytest.raises(ValueError, match="needs a post-attention norm"):
        DecoderLayer(layer.input_norm, layer.attention, layer.mlp, None, "sequential")
    with pytest.raises(ValueError, match="residual must be one of"):
        DecoderLayer(layer.input_norm, layer.attention, layer.mlp, layer.input_norm, "serial")


# -- Piece options of GPT-2, OPT and GPT-J ---------------------------------------------------------

def _contiguous_attention(**kwargs) -> Attention:
    p = "transformer.h.{i}.attn"
    return Attention(out=f"{p}.c_proj", qkv=f"{p}.c_attn", qkv_layout="contiguous", **kwargs)


@pytest.mark.parametrize("fused", [True, False])
@LOWERINGS
def test_attention_contiguous_qkv_stored_in_out(fused, lowering):
    # GPT-2: c_attn [hidden, q | k | v] and c_proj [in, out] (Conv1D), with biases, no rotary.
    att = _contiguous_attention(hidden=8, n_heads=2, n_kv_heads=2, head_dim=4, qkv_bias=True, out_bias=True,
                                stored_in_out=True, fused=fused)
    _check_attention(att, lowering, seed=30)


def test_attention_contiguous_qkv_with_grouped_query_heads():
    # [q | k | v] of different sizes, stored [out, in] (as Phi-3's qkv_proj), rotary.
    att = _contiguous_attention(hidden=8, n_heads=4, n_kv_heads=2, head_dim=2, positions=Rotary(_inv_freq(2)))
    _check_attention(att, OUT_IN, seed=31)


def test_attention_split_qkv_stored_in_out():
    att = _split_attention(hidden=8, n_heads=2, n_kv_heads=2, head_dim=4, qkv_bias=True, stored_in_out=True,
                           fused=False)
    _check_attention(att, IN_OUT, seed=32)


def test_attention_contiguous_qkv_params():
    att = _contiguous_attention(hidden=8, n_heads=2, n_kv_heads=2, head_dim=4, qkv_bias=True, out_bias=True,
                                stored_in_out=True)
    sources = {p.name: p.source.label for p in att.params("attn")}
    assert sources == {"attn.qkv.weight": "transformer.h.{i}.attn.c_attn.weight -> transpose",
                       "attn.qkv.bias": "transformer.h.{i}.attn.c_attn.bias",
                       "attn.out.weight": "transformer.h.{i}.attn.c_proj.weight -> transpose",
                       "attn.out.bias": "transformer.h.{i}.attn.c_proj.bias"}
    split = {p.name: p.source.label for p in _contiguous_attention(
        hidden=8, n_heads=2, n_kv_heads=2, head_dim=4, stored_in_out=True, fused=False).params("attn")}
    assert split["attn.k.weight"] == "transformer.h.{i}.attn.c_attn.weight -> transpose -> rows 8:16"


def test_attention_rejects_bad_layout_settings():
    with pytest.raises(ValueError, match="qkv_layout must be 'per_head' or 'contiguous'"):
        Attention(out="o", qkv="qkv", hidden=4, n_heads=2, n_kv_heads=2, head_dim=2, qkv_layout="interleaved")
    with pytest.raises(ValueError, match="stored \\[in, out\\] cannot be fused"):
        _split_attention(hidden=4, n_heads=2, n_kv_heads=2, head_dim=2, stored_in_out=True)


@LOWERINGS
def test_mlp_weights_stored_in_out(lowering):
    # GPT-2's c_fc and c_proj (Conv1D) keep their weights [in, out].
    hidden, inter = 6, 10
    rng = np.random.default_rng(33)
    mlp = MLP(up="h.{i}.mlp.c_fc", down="h.{i}.mlp.c_proj", hidden=hidden, intermediate=inter,
              activation="gelu_tanh", bias=True, stored_in_out=True)
    t = {"up.weight": _randn(rng, inter, hidden), "up.bias": _randn(rng, inter),
         "down.weight": _randn(rng, hidden, inter), "down.bias": _randn(rng, hidden)}
    checkpoint = FakeCheckpoint({"h.0.mlp.c_fc.weight": t["up.weight"].T.copy(),
                                 "h.0.mlp.c_fc.bias": t["up.bias"],
                                 "h.0.mlp.c_proj.weight": t["down.weight"].T.copy(),
                                 "h.0.mlp.c_proj.bias": t["down.bias"]})
    params = mlp.params("mlp")
    x = _randn(rng, 2, 3, hidden)
    weights = _weights(params, checkpoint, lowering)
    (out,) = _run({"x": x, **weights}, lambda v: [mlp(PieceValues(v, lowering, "mlp", params), v["x"])])
    np.testing.assert_allclose(out, ref_mlp(x, t, "gelu_tanh", False, True), **TOL)
    with pytest.raises(ValueError, match="gated MLP with weights stored"):
        MLP(up="u", down="d", gate="g", hidden=4, intermediate=6, stored_in_out=True)


def test_embedding_projects_a_narrower_token_table():
    # OPT-350m: token rows `width` wide, project_in to `hidden`, then learned positions (offset 2).
    rng = np.random.default_rng(34)
    vocab, width, hidden, n_positions = 11, 4, 6, 10
    t = {"tok": _randn(rng, vocab, width), "proj.weight": _randn(rng, hidden, width),
         "pos": _randn(rng, n_positions, hidden)}
    emb = Embedding("tok", vocab, hidden, positions="pos", n_positions=n_positions, position_offset=2,
                    projection="proj", width=width)
    params = emb.params()
    assert [(p.name, p.shape) for p in params] == [("embed.tokens", (vocab, width)),
                                                   ("embed.project.weight", (hidden, width)),
                                                   ("embed.positions", (n_positions, hidden))]
    ids = rng.integers(0, vocab, (2, 3)).astype(np.int32)
    positions = np.array([[0, 1, 2], [5, 6, 7]], np.int32)
    expected = _linear(t["tok"][ids], t["proj.weight"]) + t["pos"][positions + 2]
    head = Head(None, vocab, hidden, weight=None, tied_to="tok", projection="proj_out", width=width)
    (head_param,) = [p for p in head.params() if p.name == "lm_head.weight"]
    for lowering in (IN_OUT, OUT_IN):
        weights = _weights(params, FakeCheckpoint(t), lowering, None)
        out = _run_embedding(emb, lowering, {"ids": ids, "positions": positions, **weights}, "embed.tokens")
        np.testing.assert_allclose(out, expected, **TOL)
        # Tied and stored once: the head [vocab, width] serves as the table.
        del weights["embed.tokens"]
        weights["lm_head.weight"] = lowering.arrange(head_param, read(head_param, FakeCheckpoint(t), None))
        out = _run_embedding(emb, lowering, {"ids": ids, "positions": positions, **weights}, "lm_head.weight",
                             include_tokens=False)
        np.testing.assert_allclose(out, expected, **TOL)
    with pytest.raises(ValueError, match="needs the token table's width"):
        Embedding("tok", vocab, hidden, projection="proj")


HEAD_CASES = {
    # GPT-J: final layer norm, a bias on the logits
    "norm_and_bias": dict(norm=Norm("transformer.ln_f", 6, kind="layer", bias=True, eps=1e-5),
                          bias="lm_head.bias"),
    # OPT-350m: no final norm, project_out to a narrower head
    "projection_no_norm": dict(norm=None, projection="model.decoder.project_out", width=4),
}


@pytest.mark.parametrize("case", list(HEAD_CASES))
@pytest.mark.parametrize("n_tokens", [1, 4])
@LOWERINGS
def test_head_options(case, n_tokens, lowering):
    rng = np.random.default_rng(35 + n_tokens)
    b, hidden, vocab = 3, 6, 10
    options = HEAD_CASES[case]
    width = options.get("width", hidden)
    head = Head(vocab_size=vocab, hidden=hidden, weight="lm_head.weight", **options)
    t = {"transformer.ln_f.weight": _randn(rng, hidden) + 1, "transformer.ln_f.bias": _randn(rng, hidden),
         "model.decoder.project_out.weight": _randn(rng, width, hidden),
         "lm_head.weight": _randn(rng, vocab, width),
         "lm_head.bias": _randn(rng, vocab)}
    params = head.params()
    names = [p.name for p in params]
    if case == "norm_and_bias":
        assert names == ["final_norm.weight", "final_norm.bias", "lm_head.weight", "lm_head.bias"]
        bias = params[-1]
        assert (bias.shape == (vocab,) and bias.kind is Kind.VECTOR and bias.shard is Shard.VOCAB
                and bias.is_head)
    else:
        assert names == ["project_out.weight", "lm_head.weight"] and params[1].shape == (vocab, width)
    logits, rows = _run_head(head, params, t, lowering, rng, b, n_tokens, hidden)
    if case == "norm_and_bias":
        rows = ref_norm(rows, t["transformer.ln_f.weight"], t["transformer.ln_f.bias"], "layer", 1e-5)
        expected = _linear(rows, t["lm_head.weight"], t["lm_head.bias"])
    else:
        expected = _linear(_linear(rows, t["model.decoder.project_out.weight"]), t["lm_head.weight"])
    np.testing.assert_allclose(logits, expected, **TOL)


def test_head_rejects_a_projection_without_its_width():
    with pytest.raises(ValueError, match="needs the head's width"):
        Head(None, 10, 6, weight=None, projection="project_out")


def test_decoder_layer_post_norm():
    # OPT-350m: h = norm1(h + attn(h)); h = norm2(h + mlp(h)).
    layer = _layer("post", False)
    rng = np.random.default_rng(36)
    t_attn, checkpoint = _attention_checkpoint(layer.attention, rng)
    hidden, inter, prefix = 8, 12, "gpt_neox.layers.0"
    norms = {name: (_randn(rng, hidden, scale=0.3) + 1, _randn(rng, hidden, scale=0.3))
             for name in ("input_layernorm", "post_attention_layernorm")}
    t_mlp = {"up.weight": _randn(rng, inter, hidden, scale=0.5), "up.bias": _randn(rng, inter),
             "down.weight": _randn(rng, hidden, inter, scale=0.5), "down.bias": _randn(rng, hidden)}
    checkpoint.tensors.update({f"{prefix}.{name}.{s}": a for name, (w, b) in norms.items()
                               for s, a in (("weight", w), ("bias", b))})
    checkpoint.tensors.update({f"{prefix}.mlp.dense_{n}.{s}": t_mlp[f"{part}.{s}"] for part, n in
                               (("up", "h_to_4h"), ("down", "4h_to_h")) for s in ("weight", "bias")})
    weights = _weights(layer.params(), checkpoint, IN_OUT)
    b, n, slot, n_attend = 2, 3, 2, 5
    pad = np.array([0, 3], np.int32)
    x, step, cache_k, cache_v, (out, new_k, new_v) = _run_layer(layer, weights, rng, x_dims=(b, n, hidden),
                                                                 slot=slot, pad=pad, n_attend=n_attend)
    attended, ref_k, ref_v = ref_attention(layer.attention, t_attn, x, step["positions"], slot, pad,
                                           cache_k, cache_v, n_attend)
    h = ref_norm(x + attended, *norms["input_layernorm"], "layer", 1e-5)
    expected = ref_norm(h + ref_mlp(h, t_mlp, "gelu", False, True), *norms["post_attention_layernorm"],
                        "layer", 1e-5)
    real = slot + np.arange(n)[None, :] >= pad[:, None]
    np.testing.assert_allclose(out[real], expected[real], rtol=1e-5, atol=3e-5)
    np.testing.assert_allclose(new_k, ref_k, **TOL)
    np.testing.assert_allclose(new_v, ref_v, **TOL)
    with pytest.raises(ValueError, match="a post layer needs a post-attention norm"):
        DecoderLayer(layer.input_norm, layer.attention, layer.mlp, None, "post")
