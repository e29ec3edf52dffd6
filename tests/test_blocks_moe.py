"""The mixture-of-experts piece (decoders/blocks/moe.py) against HF transformers' own Mixtral
block and torch's routing, written into a program as the program builder does it."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_blocks import LOWERINGS, FakeCheckpoint, _randn, _run, _weights
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

from decoders.blocks import MLP, Kind, MoE, Shard
from decoders.blocks.values import PieceValues
from decoders.lowering import XlaLowering

HIDDEN, INTER = 8, 12
PREFIX = "model.layers.{i}.block_sparse_moe."


def _moe(n_experts: int, top_k: int) -> MoE:
    experts = tuple(MLP(up=f"{PREFIX}experts.{e}.w3", down=f"{PREFIX}experts.{e}.w2",
                        gate=f"{PREFIX}experts.{e}.w1", hidden=HIDDEN, intermediate=INTER)
                    for e in range(n_experts))
    return MoE(PREFIX + "gate", experts, top_k)


def _checkpoint(n_experts: int, rng) -> dict[str, np.ndarray]:
    prefix = PREFIX.format(i=0)
    tensors = {f"{prefix}gate.weight": _randn(rng, n_experts, HIDDEN)}
    for e in range(n_experts):
        tensors[f"{prefix}experts.{e}.w1.weight"] = _randn(rng, INTER, HIDDEN, scale=0.5)
        tensors[f"{prefix}experts.{e}.w3.weight"] = _randn(rng, INTER, HIDDEN, scale=0.5)
        tensors[f"{prefix}experts.{e}.w2.weight"] = _randn(rng, HIDDEN, INTER, scale=0.5)
    return tensors


def hf_block(tensors: dict[str, np.ndarray], n_experts: int, top_k: int) -> MixtralSparseMoeBlock:
    config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=n_experts,
                           num_experts_per_tok=top_k)
    block = MixtralSparseMoeBlock(config).eval()
    prefix = PREFIX.format(i=0)

    def stack(name):
        return torch.stack([torch.from_numpy(tensors[f"{prefix}experts.{e}.{name}.weight"])
                            for e in range(n_experts)])

    with torch.no_grad():
        block.gate.weight.copy_(torch.from_numpy(tensors[f"{prefix}gate.weight"]))
        block.experts.gate_up_proj.copy_(torch.cat([stack("w1"), stack("w3")], dim=1))
        block.experts.down_proj.copy_(stack("w2"))
    return block


@pytest.mark.parametrize("n_experts, top_k", [(4, 2), (4, 1), (8, 2), (3, 3)])
@LOWERINGS
def test_moe_matches_hf_mixtral_block(n_experts, top_k, lowering):
    rng = np.random.default_rng(n_experts * 10 + top_k)
    tensors = _checkpoint(n_experts, rng)
    moe = _moe(n_experts, top_k)
    params = moe.params("mlp")
    weights = _weights(params, FakeCheckpoint(tensors), lowering)
    x = _randn(rng, 2, 5, HIDDEN)
    (out,) = _run({"x": x, **weights}, lambda v: [moe(PieceValues(v, lowering, "mlp", params), v["x"])])
    with torch.no_grad():
        expected = hf_block(tensors, n_experts, top_k)(torch.from_numpy(x)).numpy()
        logits = (torch.from_numpy(x.reshape(-1, HIDDEN))
                  @ torch.from_numpy(tensors[PREFIX.format(i=0) + "gate.weight"]).T)
    chosen = {tuple(sorted(row)) for row in torch.topk(logits, top_k, dim=-1).indices.tolist()}
    assert len(chosen) > 1 or top_k == n_experts      # the tokens go to different experts
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def _routing(moe: MoE, logits: np.ndarray) -> np.ndarray:
    (weights,) = _run({"logits": logits}, lambda v: [moe.routing(v["logits"])])
    return weights


def torch_routing(logits: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """HF's router weights as a dense [tokens, experts] array, and each token's probabilities."""
    probs = torch.softmax(torch.from_numpy(logits).float(), dim=-1)
    top, index = torch.topk(probs, top_k, dim=-1)
    dense = torch.zeros_like(probs).scatter(-1, index, top / top.sum(-1, keepdim=True))
    return dense.numpy(), probs.numpy()


def test_routing_picks_the_top_k_by_value_and_renormalises():
    moe = _moe(8, 2)
    rng = np.random.default_rng(5)
    # Logits in a few clusters: many near-ties, where the order of the probabilities decides.
    logits = (rng.integers(0, 3, (256, 8)) + rng.standard_normal((256, 8)) * 1e-3).astype(np.float32)
    ours = _routing(moe, logits)
    expected, probs = torch_routing(logits, 2)
    ordered = np.sort(probs, -1)[:, ::-1]
    # Where the 2nd and 3rd probabilities are more than a few rounding steps apart the choice is unambiguous.
    clear = (ordered[:, 1] - ordered[:, 2]) > 8 * np.spacing(ordered[:, 1])
    assert clear.sum() > 200
    np.testing.assert_array_equal(ours[clear] > 0, expected[clear] > 0)
    np.testing.assert_allclose(ours[clear], expected[clear], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ours.sum(-1), 1.0, rtol=1e-6)
    assert ((ours > 0).sum(-1) == 2).all()


def test_routing_without_renormalising_keeps_the_softmax_probabilities_as_qwen3_moe():
    # Qwen3-MoE with norm_topk_prob=False: the chosen experts' probabilities as they are.
    moe = MoE(PREFIX + "gate", _moe(8, 2).experts, 2, renormalise=False)
    logits = np.random.default_rng(6).standard_normal((64, 8)).astype(np.float32)
    ours = _routing(moe, logits)
    probs = torch.softmax(torch.from_numpy(logits), dim=-1)
    top, index = torch.topk(probs, 2, dim=-1)
    expected = torch.zeros_like(probs).scatter(-1, index, top).numpy()
    np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-7)
    assert (ours.sum(-1) < 1 - 1e-3).all()


def test_routing_near_tie_goes_to_the_larger_probability_whatever_its_index():
    moe = _moe(4, 1)
    near = np.float32(0.5) + np.float32(2.0**-18)
    logits = np.array([[0.5, near, 0.1, 0.2], [near, 0.5, 0.1, 0.2], [0.1, 0.2, 0.5, near]], np.float32)
    np.testing.assert_array_equal(_routing(moe, logits), [[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1]])


def test_routing_exact_ties_go_to_the_lower_expert_index():
    # torch.topk leaves the order of equal values unspecified; the piece is deterministic.
    moe = _moe(4, 2)
    logits = np.array([[0, 0, 0, 0], [1, 3, 3, 3], [2, 0, 2, 0]], np.float32)
    np.testing.assert_allclose(_routing(moe, logits), [[0.5, 0.5, 0, 0], [0, 0.5, 0.5, 0], [0.5, 0, 0.5, 0]])


def test_moe_params():
    moe = _moe(4, 2)
    params = {p.name: p for p in moe.params("mlp")}
    assert list(params)[:3] == ["mlp.router.weight", "mlp.experts.0.gate_up.weight",
                                "mlp.experts.0.down.weight"]
    assert len(params) == 1 + 4 * 2
    router = params["mlp.router.weight"]
    assert (router.kind, router.shape, router.shard) == (Kind.LINEAR, (4, HIDDEN), Shard.REPLICATED)
    assert router.source.names == ("model.layers.{i}.block_sparse_moe.gate.weight",)
    gate_up = params["mlp.experts.3.gate_up.weight"]
    assert (gate_up.kind, gate_up.shape, gate_up.shard, gate_up.segments) == (
        Kind.LINEAR, (2 * INTER, HIDDEN), Shard.COLUMN, (INTER, INTER))
    assert gate_up.source.names == ("model.layers.{i}.block_sparse_moe.experts.3.w1.weight",
                                    "model.layers.{i}.block_sparse_moe.experts.3.w3.weight")
    down = params["mlp.experts.3.down.weight"]
    assert (down.kind, down.shape, down.shard) == (Kind.LINEAR, (HIDDEN, INTER), Shard.ROW)
    # Every weight is a plain 2-D linear: the lowerings lay them out like any other.
    assert {p.kind for p in params.values()} == {Kind.LINEAR}
    assert XlaLowering("f32", "in_out").param_dims(down) == (INTER, HIDDEN)


def test_moe_rejects_bad_settings():
    experts = _moe(4, 2).experts
    with pytest.raises(ValueError, match="top_k must be in 1..4"):
        MoE("r", experts, 5)
    odd = MLP(up="u", down="d", gate="g", hidden=HIDDEN, intermediate=INTER + 1)
    with pytest.raises(ValueError, match="same hidden and intermediate"):
        MoE("r", (*experts[:3], odd), 2)
