"""Several processes, one tensor-parallel model: two processes on loopback with two CPU devices
each form tp_degree 4 through jax's distributed runtime (runtime.distributed), and give the
tokens of one process alone.

Process 0 joins by calling distributed.initialize(); process 1 by the PYHLO_* environment only,
as an unchanged script would. Each holds and runs replicas 2p and 2p + 1 and reports back as
JSON, like the single-process runs they are compared with.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from child_env import python_path

TESTS = Path(__file__).resolve().parent
TIMEOUT_S = 600

RUN = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import torch
    from runtime import distributed

    path, mode, degrees = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    if mode == "call":                   # process 0: joins by calling initialize()
        address, processes, me = sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
        distributed.initialize(address, num_processes=processes, process_id=me)
    # mode "env": joins through PYHLO_COORDINATOR & co. when the first backend starts; "single": alone

    from decoders import NeuronAutoModelForCausalLM
    from pyhlo.dtypes import byte_size

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 320, (n,), generator=gen).tolist() for n in (9, 20)]
    runs = {}
    for tp in degrees:
        model = NeuronAutoModelForCausalLM.from_pretrained(
            path, batch_size=2, n_positions=128, context_length_estimate=[16, 32], tp_degree=tp).to_neuron()
        session = model.session
        model.sample(prompts, sequence_length=24, top_k=1, eos_token_id=[])\
        # warm: compiles on first use
        started = time.perf_counter()
        model.sample(prompts, sequence_length=24, top_k=1, eos_token_id=[])
        middle = time.perf_counter()
        tokens = model.sample(prompts, sequence_length=88, top_k=1, eos_token_id=[])
        ended = time.perf_counter()
        builder = session.builder
        declared = [(p, builder.decoder.n_layers) for p in builder.layer_params()]
        declared += [(p, 1) for p in builder.shared_params()]
        run = {"tokens": tokens.tolist(), "device_bytes": session.device_bytes(),
               "local": session.placement.local, "processes": session.backend.process_count,
               "weight_bytes": sum(int(np.prod(builder.spec(p).dims)) * byte_size(builder.spec(p).dtype) * n
                                   for p, n in declared),
               "cache_bytes_per_replica": model.kv_cache.byte_size // tp,
               # 64 more decode steps: the time per step, prefill and fixed costs cancelled out
               "decode_ms_per_step": ((ended - middle) - (middle - started)) / 64 * 1000}
        if session.backend.process_count > 1:
            others = [r for r in range(tp) if r not in session.placement.local]
            try:
                session.placement.host(session.kv_cache.keys[0], others[0])
            except ValueError as err:
                run["remote_host_error"] = str(err)
            try:
                session.backend.to_device(np.zeros(3, np.float32), replica=others[0])
            except ValueError as err:
                run["remote_put_error"] = str(err)
            run["cache_key_parts"] = session.backend.cache_key_parts()
            run["entropy"] = [distributed.agreed_entropy(), distributed.agreed_entropy()]
            # Unseeded sampling: every process's replicas must draw the same tokens.
            run["sampled"] = model.sample(prompts, sequence_length=40, top_k=20, temperature=1.5,
                                          eos_token_id=[]).tolist()
        runs[tp] = run
    print(json.dumps(runs))
""")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int, cache_dir: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYHLO_COORDINATOR", "PYHLO_NUM_PROCESSES", "PYHLO_PROCESS_ID",
                        "PYHLO_LOCAL_DEVICES")}
    env.update(PYTHONPATH=python_path(str(TESTS.parent), str(TESTS)), PYHLO_CACHE_DIR=str(cache_dir),
               PYTHONFAULTHANDLER="1", PYHLO_PLATFORM="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", **extra)
    return env


def _report(done_stdout: str) -> dict:
    return json.loads(done_stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def checkpoint(tiny_llama):
    return tiny_llama("gqa_tied_llama3", "safetensors")[1]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("multi-process-compile-cache")


@pytest.fixture(scope="module")
def single(checkpoint, cache_dir):
    """tp 1 and tp 4 in one process with four CPU devices."""
    done = subprocess.run([sys.executable, "-c", RUN, str(checkpoint), "single", "[1, 4]"],
                          env=_env(4, cache_dir), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    return _report(done.stdout), len(list(cache_dir.glob("*.exe")))


def _run_together(commands: list, folder: Path) -> list[str]:
    """Start every command, wait for all of them; the first to fail (or the deadline) stops
    the others at once, rather than leaving them waiting for a partner that is gone."""
    logs = [(folder / f"process{i}.out", folder / f"process{i}.err") for i in range(len(commands))]
    processes = []
    for (command, env), (out, err) in zip(commands, logs):
        with open(out, "w") as stdout, open(err, "w") as stderr:
            processes.append(subprocess.Popen(command, env=env, stdout=stdout, stderr=stderr))
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in processes):
                break
            time.sleep(0.2)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=60)
    report = [(i, p.returncode, out.read_text()[-1500:], err.read_text()[-3000:])
              for i, (p, (out, err)) in enumerate(zip(processes, logs))]
    assert all(p.returncode == 0 for p in processes), report   # -9: stopped after another failed
    return [out.read_text() for out, _ in logs]


@pytest.fixture(scope="module")
def two_processes(checkpoint, cache_dir, single, tmp_path_factory):
    """tp 4 over two processes with two CPU devices each, on loopback."""
    address = f"127.0.0.1:{_free_port()}"
    outputs = _run_together([
        ([sys.executable, "-c", RUN, str(checkpoint), "call", "[4]", address, "2", "0"], _env(2, cache_dir)),
        ([sys.executable, "-c", RUN, str(checkpoint), "env", "[4]"],
         _env(2, cache_dir, PYHLO_COORDINATOR=address, PYHLO_NUM_PROCESSES="2", PYHLO_PROCESS_ID="1",
              PYHLO_LOCAL_DEVICES="2")),
    ], tmp_path_factory.mktemp("two-processes"))
    return [_report(stdout)["4"] for stdout in outputs], len(list(cache_dir.glob("*.exe")))


def test_two_processes_give_the_tokens_of_one(single, two_processes):
    (runs, _), (processes, _) = single, two_processes
    assert runs["4"]["tokens"] == runs["1"]["tokens"]
    for run in processes:
        assert run["processes"] == 2
        assert run["tokens"] == runs["1"]["tokens"]


def test_each_process_holds_only_its_replicas(single, two_processes):
    (runs, _), (processes, _) = single, two_processes
    assert [run["local"] for run in processes] == [[0, 1], [2, 3]]
    # Each process's devices hold what those replicas hold in one process, and nothing more:
    # the weights as declared for one replica and its share of the caches.
    assert processes[0]["device_bytes"] + processes[1]["device_bytes"] == runs["4"]["device_bytes"]
    whole = runs["1"]["weight_bytes"] + runs["1"]["cache_bytes_per_replica"]
    for run in processes:
        share = run["weight_bytes"] + run["cache_bytes_per_replica"]
        assert run["device_bytes"] == [share] * 2
        # A quarter of the split weights and caches, plus what every replica keeps whole: here,
        # with so tiny a model, that is nearly half (the 320 x 64 embedding table, which tp 1
        # shares with the tied LM head, and 2 KV heads over 4 replicas).
        assert whole / 4 < share < whole / 2
        # Two replicas' parts, never four copies.
        assert sum(run["device_bytes"]) < whole


def test_another_process_s_replica_is_refused_with_a_clear_error(two_processes):
    (first, second), _ = two_processes
    assert ("replica 2 is held by another process: process 0 holds replicas [0, 1]"
            in first["remote_host_error"])
    assert ("replica 0 is held by another process: process 1 holds replicas [2, 3]"
            in second["remote_host_error"])
    assert "process 0" in second["remote_put_error"] and "holds replicas [2, 3]" in second["remote_put_error"]


def test_multi_process_programs_have_cache_entries_of_their_own(single, two_processes):
    (_, after_single), (processes, after_both) = single, two_processes
    # The same programs, compiled for devices across processes: new keys, not the single process's.
    assert processes[0]["cache_key_parts"]["processes"] == processes[1]["cache_key_parts"]["processes"]
    assert after_both > after_single


def test_processes_agree_on_random_draws(two_processes):
    (first, second), _ = two_processes
    # What every replica must draw alike (an unseeded sampler's state) is drawn once, for all.
    assert first["entropy"] == second["entropy"] and first["entropy"][0] != first["entropy"][1]
    assert first["sampled"] == second["sampled"]
