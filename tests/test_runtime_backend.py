"""The backend interface: compile PyHLO modules with XLA, run them by position or by name."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from pyhlo import compile_py_func
from runtime import get_backend
from runtime.backend import XlaBackend

MATMUL = {"lhs_contracting_dimensions": [1], "rhs_contracting_dimensions": [0]}


def add_and_matmul(scribe):
    f32 = scribe.f32
    x = f32[4, 8].Parameter(parameter_number=0, name="x")
    y = f32[4, 8].Parameter(parameter_number=1, name="y")
    w = f32[8, 3].Parameter(parameter_number=2, name="w")
    return f32[4, 8].Add(x, y), f32[4, 3].Dot(x, w, dot_dimension_numbers=MATMUL)


def cache_update(scribe):
    """Write one row into a [64, 1024] cache in place: the cache parameter is aliased to the output."""
    cache = scribe.f32[64, 1024].Parameter(parameter_number=0, name="cache")
    row = scribe.f32[1, 1024].Parameter(parameter_number=1, name="row")
    position = scribe.s32[()].Parameter(parameter_number=2, name="position")
    zero = scribe.s32[()].Constant(constant_value=0)
    updated = scribe.f32[64, 1024].DynamicUpdateSlice(cache, row, position, zero)
    return updated.set_alias_to(cache)


@pytest.fixture(scope="module")
def backend():
    return get_backend("xla", "cpu")


@pytest.fixture(scope="module")
def add_matmul_exe(backend):
    return backend.compile(compile_py_func(add_and_matmul).SerializeToString())


@pytest.fixture
def xyw():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((4, 8), np.float32), rng.standard_normal((4, 8), np.float32),
            rng.standard_normal((8, 3), np.float32))


def test_run_with_ordered_inputs_matches_numpy(backend, add_matmul_exe, xyw):
    x, y, w = xyw
    total, product = add_matmul_exe.run([x, y, w])  # the tuple result comes back as a list
    np.testing.assert_array_equal(backend.to_host(total), x + y)
    np.testing.assert_allclose(backend.to_host(product), x @ w, rtol=1e-5, atol=1e-5)


def test_run_with_named_inputs_and_device_buffers(backend, add_matmul_exe, xyw):
    x, y, w = xyw
    assert add_matmul_exe.parameter_names == ("x", "y", "w")
    weights_on_device = backend.to_device(w)
    total, product = add_matmul_exe.run({"w": weights_on_device, "x": x, "y": y})
    np.testing.assert_array_equal(backend.to_host(total), x + y)
    np.testing.assert_allclose(backend.to_host(product), x @ w, rtol=1e-5, atol=1e-5)


def test_missing_or_unknown_input_names_are_errors(add_matmul_exe, xyw):
    x, y, w = xyw
    with pytest.raises(ValueError, match=r"missing 'w'.*expected inputs: x, y, w"):
        add_matmul_exe.run({"x": x, "y": y})
    with pytest.raises(ValueError, match=r"unknown 'weights'.*expected inputs: x, y, w"):
        add_matmul_exe.run({"x": x, "y": y, "w": w, "weights": w})
    with pytest.raises(ValueError, match="got 2 inputs, expected 3"):
        add_matmul_exe.run([x, y])


def test_wrong_shape_or_type_names_the_input(add_matmul_exe, xyw):
    x, y, w = xyw
    # Same byte size as f32[8,3], which PJRT alone would accept.
    with pytest.raises(ValueError, match=r"input 'w' is float32\[3, 8\], expected w: f32\[8,3\]"):
        add_matmul_exe.run([x, y, w.T.copy()])
    with pytest.raises(ValueError, match=r"input 'x' is int32\[4, 8\]"):
        add_matmul_exe.run([x.astype(np.int32), y, w])


def test_aliased_cache_is_donated_and_updated_in_place(backend):
    exe = backend.compile(compile_py_func(cache_update).SerializeToString())
    assert exe.donated_parameters == ("cache",)
    cache = backend.to_device(np.zeros((64, 1024), np.float32))

    (new_cache,) = exe.run({"cache": cache, "row": np.ones((1, 1024), np.float32), "position": 5})

    assert cache.is_deleted()  # donated: the caller's buffer is consumed
    # A buffer made from numpy may share the host array's memory, which XLA cannot take
    # over; from the first output on, the cache's memory belongs to XLA and is reused.
    address = new_cache.unsafe_buffer_pointer()
    (newer_cache,) = exe.run({"cache": new_cache, "row": np.full((1, 1024), 2, np.float32), "position": 6})
    assert new_cache.is_deleted()
    assert newer_cache.unsafe_buffer_pointer() == address
    expected = np.zeros((64, 1024), np.float32)
    expected[5], expected[6] = 1, 2
    np.testing.assert_array_equal(backend.to_host(newer_cache), expected)
    # XLA wrote into the cache: the optimized module copies nothing.
    assert "copy(" not in exe.hlo_text()


def wide_and_narrow_outputs(scribe):
    x = scribe.s64[3].Parameter(parameter_number=0, name="x")
    h = scribe.bf16[2, 5].Parameter(parameter_number=1, name="h")
    return scribe.s64[3].Add(x, x), scribe.bf16[2, 5].Multiply(h, h)


def test_later_runs_wrap_outputs_as_the_first_run_does(backend):
    # The first run learns each output's shape, type and device; later runs wrap the
    # outputs from that (pjrt.OutputWrapping): the same buffers, values and devices.
    exe = backend.compile(compile_py_func(wide_and_narrow_outputs).SerializeToString())
    x = np.array([2**40 + 1, -3, 7], np.int64)
    h = np.arange(10, dtype=np.float32).reshape(2, 5).astype(ml_dtypes.bfloat16)
    first = exe.run([x, h])
    for step in range(3):
        later = exe.run([x * (step + 2), h])
        for a, b in zip(first, later):
            assert (a.shape, a.dtype, a.devices()) == (b.shape, b.dtype, b.devices())
        np.testing.assert_array_equal(backend.to_host(later[0]), 2 * x * (step + 2))
        np.testing.assert_array_equal(backend.to_host(later[1]), h * h)
    # An output of a later run goes back in as an input.
    again = exe.run_buffers([later[0], later[1]])
    np.testing.assert_array_equal(backend.to_host(again[0]), 4 * x * 4)


def test_bf16_round_trips_exactly_through_numpy(backend):
    bits = np.array([0x0000, 0x8000, 0x0001, 0x3F80, 0xBFC0, 0x7F80, 0xFF80, 0x7FC1, 0x7F7F, 0x1234],
                    dtype=np.uint16)  # zeros, a subnormal, infinities, a NaN with payload, max
    values = bits.view(ml_dtypes.bfloat16)

    def copy(scribe):
        return scribe.bf16[10].Copy(scribe.bf16[10].Parameter(parameter_number=0, name="x"))

    on_device = backend.to_device(values)
    np.testing.assert_array_equal(backend.to_host(on_device).view(np.uint16), bits)
    exe = backend.compile(compile_py_func(copy).SerializeToString())
    (out,) = exe.run([values])
    assert backend.to_host(out).dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(backend.to_host(out).view(np.uint16), bits)


def test_bf16_torch_tensors_go_in_bit_exact(backend):
    torch = pytest.importorskip("torch")
    tensor = torch.tensor([1.0, -2.5, 3.0e38, 1.0e-40, float("inf")], dtype=torch.bfloat16)
    tensor = torch.cat([tensor, torch.tensor([0x7FC1], dtype=torch.int16).view(torch.bfloat16)])

    host = backend.to_host(backend.to_device(tensor))

    assert host.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(host.view(np.int16), tensor.view(torch.int16).numpy())


def test_64_bit_integers_keep_their_width(backend):
    for values in (np.array([2**64 - 1, 2**63 + 5, 1], np.uint64), np.array([-(2**62), 2**40], np.int64)):
        host = backend.to_host(backend.to_device(values))
        assert host.dtype == values.dtype
        np.testing.assert_array_equal(host, values)


def test_to_device_keeps_shape_type_and_values_of_any_layout(backend):
    grid = np.arange(24, dtype=np.float32).reshape(4, 6)
    for values in (grid.T, grid[:, ::2], np.int32(7), np.array(True), np.zeros((0, 3), np.int8),
                   np.array([1.5, -2.25], np.float64)):
        host = np.asarray(values)
        buffer = backend.to_device(values)
        assert (buffer.shape, buffer.dtype) == (host.shape, host.dtype)
        np.testing.assert_array_equal(backend.to_host(buffer), host)


def test_serialized_executable_runs_after_reload(backend, add_matmul_exe, xyw):
    hlo = compile_py_func(add_and_matmul).SerializeToString()
    reloaded = backend.deserialize(add_matmul_exe.serialize(), hlo)
    x, y, w = xyw
    total, _ = reloaded.run({"x": x, "y": y, "w": w})
    np.testing.assert_array_equal(backend.to_host(total), x + y)


def test_inspection_text_graph_and_cost(backend):
    hlo = compile_py_func(add_and_matmul).SerializeToString()
    assert "dot(" in backend.hlo_text(hlo)
    cost = backend.cost_analysis(hlo)
    assert cost["flops"] >= 2 * 4 * 8 * 3
    assert cost["bytes accessed"] > 0
    from runtime import pjrt

    assert pjrt.hlo_dot_graph(hlo).lstrip().startswith("digraph")
    import jaxlib

    assert pjrt.compiler_version("cpu").startswith(f"jaxlib {jaxlib.__version__}")


def test_get_backend_choice_by_argument_and_environment(monkeypatch):
    monkeypatch.delenv("PYHLO_BACKEND", raising=False)
    monkeypatch.delenv("PYHLO_PLATFORM", raising=False)
    assert isinstance(get_backend(), XlaBackend)
    monkeypatch.setenv("PYHLO_PLATFORM", "cpu")
    assert get_backend().platform == "cpu"
    monkeypatch.setenv("PYHLO_BACKEND", "neuronx-cc")
    assert get_backend().name == "neuronx-cc"
    with pytest.raises(ValueError, match="valid backends: xla, neuronx-cc"):
        get_backend("tvm")
    with pytest.raises(ValueError, match="valid platforms: cpu, cuda, neuron"):
        get_backend("xla", "tpu")


def test_missing_neuron_plugin_says_what_to_install():
    from runtime import pjrt

    if "neuron" in pjrt.available_platforms():
        pytest.skip("the Neuron PJRT plugin is installed here")
    with pytest.raises(RuntimeError, match="libneuronxla"):
        get_backend("xla", "neuron")


def test_replicas_need_devices(backend):
    if backend.device_count > 1:
        pytest.skip("several devices here")
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
        backend.compile(compile_py_func(add_and_matmul).SerializeToString(), num_replicas=2)


def test_one_process_holds_every_replica_and_keys_its_cache_as_before(backend):
    from runtime.placement import Placement

    assert backend.process_count == 1 and backend.process_index == 0
    assert backend.local_replicas(backend.device_count) == list(range(backend.device_count))
    assert "processes" not in backend.cache_key_parts()  # single-process keys are unchanged
    placement = Placement(backend)
    assert placement.local == [0]
    value = placement.put(np.arange(3, dtype=np.int32))
    np.testing.assert_array_equal(placement.host(value), np.arange(3))


def test_distributed_settings_are_checked_before_anything_starts(monkeypatch):
    from runtime import distributed

    with pytest.raises(ValueError, match="coordinator_address must be 'host:port'"):
        distributed.initialize("localhost", num_processes=2, process_id=0)
    with pytest.raises(ValueError, match=r"process_id must be an int in 0\.\.1, got 2"):
        distributed.initialize("localhost:1234", num_processes=2, process_id=2)
    monkeypatch.setenv("PYHLO_COORDINATOR", "localhost:1234")
    monkeypatch.delenv("PYHLO_NUM_PROCESSES", raising=False)
    monkeypatch.setenv("PYHLO_PROCESS_ID", "0")
    with pytest.raises(ValueError, match="PYHLO_COORDINATOR is set, but PYHLO_NUM_PROCESSES"):
        distributed.initialize_from_environment()
    assert not distributed.is_initialized()


def test_distributed_runtime_cannot_start_after_a_backend(backend):
    from runtime import distributed

    assert backend.device_count >= 1  # jax's CPU client exists: too late to join other processes
    with pytest.raises(RuntimeError, match="before building any model or backend"):
        distributed.initialize("127.0.0.1:1", num_processes=1, process_id=0)
    assert not distributed.is_initialized()
