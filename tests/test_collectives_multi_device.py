"""Replicated programs on four CPU devices: all-reduce within replica groups.

XLA:CPU shows several devices only when XLA_FLAGS asks for them before jax starts,
so the program runs in a fresh Python process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
from child_env import python_path

REPO_ROOT = Path(__file__).resolve().parents[1]

FOUR_REPLICAS = textwrap.dedent("""
    import json
    import numpy as np
    from pyhlo import compile_py_func
    from runtime import get_backend

    def add(scribe):
        x = scribe.f32[()].Parameter(parameter_number=0)
        y = scribe.f32[()].Parameter(parameter_number=1)
        return scribe.f32[()].Add(x, y)

    def sums(scribe):
        v = scribe.f32[8].Parameter(parameter_number=0, name="v")
        pairs = scribe.f32[8].AllReduce(v, replica_groups=[[0, 1], [2, 3]], to_apply=add)
        everyone = scribe.f32[8].AllReduce(v, replica_groups=[[0, 1, 2, 3]], to_apply=add)
        return pairs, everyone

    backend = get_backend("xla", "cpu")
    hlo = compile_py_func(sums).SerializeToString()
    exe = backend.compile(hlo, num_replicas=4)
    inputs = [{"v": backend.to_device(np.arange(8, dtype=np.float32) * 10**r, replica=r)} for r in range(4)]
    outputs = exe.run_replicated(inputs)
    reloaded = backend.deserialize(exe.serialize(), hlo, num_replicas=4)
    again = reloaded.run_replicated(inputs)
    print(json.dumps({
        "devices": backend.device_count,
        "pairs": [backend.to_host(out[0]).tolist() for out in outputs],
        "everyone": [backend.to_host(out[1]).tolist() for out in outputs],
        "on_device": [str(out[0].devices().pop()) for out in outputs],
        "reloaded_everyone": [backend.to_host(out[1]).tolist() for out in again],
    }))
""")


def test_all_reduce_within_replica_groups_on_four_cpu_devices():
    env = dict(os.environ, PYTHONPATH=python_path(REPO_ROOT),
               XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYHLO_PLATFORM="cpu")
    done = subprocess.run([sys.executable, "-c", FOUR_REPLICAS], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])

    v = [np.arange(8) * 10**r for r in range(4)]  # replica r holds v[r]
    assert result["devices"] == 4
    assert result["pairs"] == [(v[0] + v[1]).tolist()] * 2 + [(v[2] + v[3]).tolist()] * 2
    assert result["everyone"] == [sum(v).tolist()] * 4
    assert result["reloaded_everyone"] == result["everyone"]
    assert len(set(result["on_device"])) == 4  # each replica's output stays on its own device
