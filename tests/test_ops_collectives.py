"""Collectives on 4 replicas: XLA:CPU forced to show 4 host devices, in a subprocess.

`XLA_FLAGS=--xla_force_host_platform_device_count=4` only counts before the
backend starts, so the programs run in a fresh interpreter that saves every
replica's outputs; the tests here compare them with numpy.
"""
from __future__ import annotations

import os
import subprocess
import sys

import extra_ops
import numpy as np
import pytest
from child_env import python_path

from pyhlo import compile_py_func
from pyhlo.ops import collectives

REPLICAS = 4
SHAPE = (4, 6)
ALL = [[0, 1, 2, 3]]
PAIRS = [[0, 1], [2, 3]]


def inputs() -> list[np.ndarray]:
    """Replica r's input x_r."""
    rng = np.random.default_rng(0)
    return [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(REPLICAS)]


def program(scribe):
    x = scribe.f32[SHAPE].Parameter(parameter_number=0, name="x")
    return [
        collectives.all_reduce_sum(x, ALL),
        collectives.all_reduce_sum(x, PAIRS),
        collectives.all_gather(x, 0, ALL),
        collectives.all_gather(x, 1, PAIRS),
        extra_ops.reduce_scatter(x, 0, ALL),
        extra_ops.reduce_scatter(x, 1, PAIRS),
        collectives.replica_id(scribe),
    ]


OUTPUTS = ["sum_all", "sum_pairs", "gather_all_dim0", "gather_pairs_dim1", "scatter_all_dim0",
           "scatter_pairs_dim1", "replica_id"]


def save_replicated_outputs(path: str) -> None:
    """Run `program` on 4 replicas and save output `name` of replica r as `name.r` (subprocess side)."""
    from runtime.select import get_backend

    backend = get_backend()
    executable = backend.compile(compile_py_func(program).SerializeToString(), num_replicas=REPLICAS)
    per_replica = [[backend.to_device(x, replica=r)] for r, x in enumerate(inputs())]
    results = executable.run_replicated(per_replica)
    arrays = {f"{name}.{r}": backend.to_host(out)
              for r, outs in enumerate(results) for name, out in zip(OUTPUTS, outs)}
    np.savez(path, **arrays)


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("collectives") / "outputs.npz")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", PYHLO_PLATFORM="cpu",
               PYTHONPATH=python_path(root, os.path.join(root, "tests")))
    code = f"import test_ops_collectives as t; t.save_replicated_outputs({path!r})"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(path) as saved:
        return {key: saved[key] for key in saved.files}


def _per_replica(outputs, name):
    return [outputs[f"{name}.{r}"] for r in range(REPLICAS)]


def test_all_reduce_sum(outputs):
    xs = inputs()
    for out in _per_replica(outputs, "sum_all"):
        np.testing.assert_allclose(out, sum(xs), rtol=1e-6, atol=1e-6)
    for r, out in enumerate(_per_replica(outputs, "sum_pairs")):
        group = PAIRS[r // 2]
        np.testing.assert_allclose(out, xs[group[0]] + xs[group[1]], rtol=1e-6, atol=1e-6)


def test_all_gather_concatenates_in_group_order(outputs):
    xs = inputs()
    for out in _per_replica(outputs, "gather_all_dim0"):
        assert out.shape == (16, 6)
        np.testing.assert_array_equal(out, np.concatenate(xs, axis=0))
    for r, out in enumerate(_per_replica(outputs, "gather_pairs_dim1")):
        assert out.shape == (4, 12)
        np.testing.assert_array_equal(out, np.concatenate([xs[i] for i in PAIRS[r // 2]], axis=1))


def test_reduce_scatter_keeps_one_block_of_the_sum(outputs):
    xs = inputs()
    total = sum(xs)
    for r, out in enumerate(_per_replica(outputs, "scatter_all_dim0")):
        np.testing.assert_allclose(out, total[r : r + 1], rtol=1e-6, atol=1e-6)
    for r, out in enumerate(_per_replica(outputs, "scatter_pairs_dim1")):
        pair_sum = sum(xs[i] for i in PAIRS[r // 2])
        block = r % 2
        np.testing.assert_allclose(out, pair_sum[:, 3 * block : 3 * block + 3], rtol=1e-6, atol=1e-6)


def test_replica_id(outputs):
    ids = _per_replica(outputs, "replica_id")
    assert [int(i) for i in ids] == [0, 1, 2, 3]
    assert all(i.dtype == np.uint32 for i in ids)


def test_groups_must_have_equal_sizes():
    def bad(scribe):
        return collectives.all_reduce_sum(scribe.f32[2].Parameter(parameter_number=0), [[0, 1, 2], [3]])

    with pytest.raises(ValueError, match="replica_groups must be non-empty groups of equal size"):
        compile_py_func(bad)


def test_reduce_scatter_needs_an_even_split():
    def bad(scribe):
        return extra_ops.reduce_scatter(scribe.f32[3, 2].Parameter(parameter_number=0), 0, ALL)

    with pytest.raises(ValueError, match=r"dim 0 of f32\[3,2\] does not split into 4 parts"):
        compile_py_func(bad)
