"""The on-disk compile cache: hits, misses, damaged entries and concurrent writers."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from child_env import python_path

from pyhlo import compile_py_func
from runtime import CompileCache, get_backend
from runtime.compile_cache import cache_key

REPO_ROOT = Path(__file__).resolve().parents[1]


def scaled_sum(scribe):
    x = scribe.f32[16].Parameter(parameter_number=0, name="x")
    y = scribe.f32[16].Parameter(parameter_number=1, name="y")
    two = scribe.f32[16].Broadcast(scribe.f32[()].Constant(constant_value=2.0), dimensions=[])
    return scribe.f32[16].Add(scribe.f32[16].Multiply(x, two), y)


HLO = compile_py_func(scaled_sum).SerializeToString()
X = np.arange(16, dtype=np.float32)
Y = np.full(16, 0.5, np.float32)


@pytest.fixture
def backend(monkeypatch):
    """The cpu backend, counting its compiler calls in backend.compile_calls."""
    backend = get_backend("xla", "cpu")
    backend.compile_calls = 0
    compile_with_xla = backend.compile

    def counting_compile(hlo_bytes, num_replicas=1):
        backend.compile_calls += 1
        return compile_with_xla(hlo_bytes, num_replicas=num_replicas)

    monkeypatch.setattr(backend, "compile", counting_compile)
    return backend


def check_runs(backend, exe):
    (out,) = exe.run({"x": X, "y": Y})
    np.testing.assert_array_equal(backend.to_host(out), 2 * X + Y)


def test_first_call_compiles_second_call_loads(backend, tmp_path):
    cache = CompileCache(tmp_path)
    exe, hit = cache.get_or_compile(backend, HLO)
    assert (hit, backend.compile_calls) == (False, 1)
    check_runs(backend, exe)

    exe, hit = CompileCache(tmp_path).get_or_compile(backend, HLO)  # a fresh process would do this
    assert (hit, backend.compile_calls) == (True, 1)
    check_runs(backend, exe)
    assert (cache.misses, cache.hits) == (1, 0) and cache.compile_seconds > 0


def test_key_covers_replicas_and_compiler_flags(backend, monkeypatch):
    key = cache_key(backend, HLO)
    assert key != cache_key(backend, HLO, num_replicas=2)
    assert key != cache_key(backend, HLO + b"\0")
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    assert key != cache_key(backend, HLO)


@pytest.mark.parametrize("damage", ["flip bytes in the middle", "truncate"])
def test_damaged_entry_is_reported_deleted_and_rebuilt(backend, tmp_path, damage):
    cache = CompileCache(tmp_path)
    cache.get_or_compile(backend, HLO)
    (entry,) = tmp_path.glob("*.exe")
    data = bytearray(entry.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 3]
    else:
        middle = len(data) // 2
        data[middle:middle + 16] = bytes(b ^ 0xFF for b in data[middle:middle + 16])
    entry.write_bytes(bytes(data))

    with pytest.warns(RuntimeWarning, match=entry.name):
        exe, hit = cache.get_or_compile(backend, HLO)

    assert not hit and backend.compile_calls == 2 and cache.stats.rebuilt == 1
    check_runs(backend, exe)
    assert CompileCache(tmp_path).get_or_compile(backend, HLO)[1]  # the rebuilt entry is whole


def doubled_difference(scribe):
    x = scribe.f32[16].Parameter(parameter_number=0, name="x")
    y = scribe.f32[16].Parameter(parameter_number=1, name="y")
    return scribe.f32[16].Subtract(scribe.f32[16].Add(x, x), y)


def test_an_entry_stored_under_another_programs_key_is_rebuilt_not_run(backend, tmp_path):
    """Same parameters, same output shape: the swapped executable would run and give 2x - y."""
    other_hlo = compile_py_func(doubled_difference).SerializeToString()
    cache = CompileCache(tmp_path)
    cache.get_or_compile(backend, HLO)
    cache.get_or_compile(backend, other_hlo)
    mine, other = (Path(cache.path_of(cache_key(backend, hlo))) for hlo in (HLO, other_hlo))
    mine.write_bytes(other.read_bytes())

    with pytest.warns(RuntimeWarning, match="not of the key it is stored under"):
        exe, hit = cache.get_or_compile(backend, HLO)
    assert not hit and backend.compile_calls == 3 and cache.stats.rebuilt == 1
    check_runs(backend, exe)
    assert CompileCache(tmp_path).get_or_compile(backend, HLO)[1]


def test_cache_dir_and_switch_from_environment(backend, tmp_path, monkeypatch):
    monkeypatch.setenv("PYHLO_CACHE_DIR", str(tmp_path / "from-env"))
    assert CompileCache().dir == str(tmp_path / "from-env")

    monkeypatch.setenv("PYHLO_CACHE", "0")
    cache = CompileCache()
    assert [cache.get_or_compile(backend, HLO)[1] for _ in range(2)] == [False, False]
    assert backend.compile_calls == 2 and not (tmp_path / "from-env").exists()


CONCURRENT_COMPILE = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from runtime import CompileCache, get_backend

    cache_dir, gate, hlo_file, ready = sys.argv[1:]
    backend = get_backend("xla", "cpu")
    hlo = open(hlo_file, "rb").read()
    open(ready, "w").close()
    while not os.path.exists(gate):  # start compiling together
        time.sleep(0.001)
    exe, hit = CompileCache(cache_dir).get_or_compile(backend, hlo)
    (out,) = exe.run({"x": np.arange(16, dtype=np.float32), "y": np.full(16, 0.5, np.float32)})
    print(hit, float(backend.to_host(out).sum()))
""")


def test_two_processes_compiling_the_same_module_both_succeed(tmp_path):
    hlo_file, gate = tmp_path / "module.pb", tmp_path / "go"
    hlo_file.write_bytes(HLO)
    env = dict(os.environ, PYTHONPATH=python_path(REPO_ROOT), PYHLO_CACHE="1")
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    processes = [
        subprocess.Popen([sys.executable, "-c", CONCURRENT_COMPILE, str(tmp_path / "cache"), str(gate),
                          str(hlo_file), str(r)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
        for r in ready
    ]
    deadline = time.monotonic() + 60
    while not all(r.exists() for r in ready) and time.monotonic() < deadline:
        time.sleep(0.01)
    gate.touch()
    results = [p.communicate(timeout=120) for p in processes]

    hits = []
    for process, (out, err) in zip(processes, results):
        assert process.returncode == 0, err
        hit, total = out.split()
        hits.append(hit)
        assert total == str(float((2 * X + Y).sum()))
    assert "False" in hits  # usually both compile and write at once; a late starter may load instead
    assert ([p.name for p in (tmp_path / "cache").iterdir()]
            == [cache_key(get_backend("xla", "cpu"), HLO) + ".exe"])
