"""Shared fixtures, and the `cpu_only` marker.

The suite runs on pyhlo's default platform (runtime.get_backend()). Tests of a fact of XLA:CPU
or of pyhlo's CPU kernels carry `@pytest.mark.cpu_only` and are skipped where that platform is
not cpu. `PYHLO_TEST_LOWERING_AS=cuda` runs the rest as a GPU machine would see them, on this
XLA:CPU: every model takes the lowering choose_lowering() picks for cuda, and the `cpu_only`
tests are skipped as there.
"""

import os
from types import SimpleNamespace

import pytest

LOWERING_AS = "PYHLO_TEST_LOWERING_AS"


def lowering_platform() -> str | None:
    """The platform whose lowering the models built in the tests take (None: the default's)."""
    return os.environ.get(LOWERING_AS) or None


def pytest_configure(config):
    if lowering_platform() not in (None, "cuda"):
        raise pytest.UsageError(f"{LOWERING_AS}={lowering_platform()!r}: expected cuda, "
                                "or the variable unset")


def _not_cpu_reason() -> str | None:
    """Why `cpu_only` tests are skipped in this run (None: they run)."""
    platform = lowering_platform()
    if platform is not None:
        return (f"a fact of XLA:CPU or of pyhlo's CPU kernels; models here take the {platform} lowering "
                f"({LOWERING_AS})")
    from runtime import get_backend

    platform = get_backend().platform
    if platform != "cpu":
        return f"a fact of XLA:CPU or of pyhlo's CPU kernels; pyhlo's default platform here is {platform}"
    return None


def pytest_collection_modifyitems(config, items):
    marked = [item for item in items if item.get_closest_marker("cpu_only")]
    reason = _not_cpu_reason() if marked else None
    if reason:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=reason))


def _take_lowering_of(monkeypatch, platform: str) -> None:
    """Models built from here on for an XLA:CPU backend take the lowering choose_lowering() picks
    for `platform`, and still run on XLA:CPU. A model given a backend of another platform (a
    NeuronCCBackend, say) keeps that platform's lowering."""
    import decoders.model
    from decoders.platform_choice import choose_lowering

    def choose(neuron_config, backend, *args, **kwargs):
        if getattr(backend, "platform", None) == "cpu":
            backend = SimpleNamespace(platform=platform)
        return choose_lowering(neuron_config, backend, *args, **kwargs)

    monkeypatch.setattr(decoders.model, "choose_lowering", choose)


@pytest.fixture
def as_if_on(monkeypatch):
    """as_if_on("cuda"): the models this test builds from then on take the lowering
    choose_lowering() picks for cuda (see _take_lowering_of)."""
    return lambda platform: _take_lowering_of(monkeypatch, platform)


@pytest.fixture(scope="session", autouse=True)
def _models_take_the_tested_lowering():
    """PYHLO_TEST_LOWERING_AS: for the whole session, so that models built by module-scoped
    fixtures take that lowering too."""
    platform = lowering_platform()
    if platform is None:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        _take_lowering_of(patch, platform)
        yield


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of the real SmolLM2-135M-Instruct GGUF, fetched once into the model cache."""
    from decoders.checkpoints.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session", autouse=True)
def _compile_cache_dir(tmp_path_factory):
    """Tests compile into a cache of their own unless PYHLO_CACHE_DIR says otherwise."""
    if "PYHLO_CACHE_DIR" not in os.environ:
        os.environ["PYHLO_CACHE_DIR"] = str(tmp_path_factory.mktemp("compile-cache"))
    # Which products take the matrix-vector kernel is measured per machine; tests pin the
    # limits so that the programs they check have the same structure everywhere.
    os.environ.setdefault("PYHLO_MATVEC_MAX_ROWS", "f32=4,bf16=4,s8=8,blocks=8")
    if "PYHLO_GGUF_CACHE" not in os.environ:
        os.environ["PYHLO_GGUF_CACHE"] = str(tmp_path_factory.mktemp("converted-gguf"))
    yield


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(hf_model, checkpoint_dir) for a variant and format, written once per session."""
    from tiny_llama import make_model, save

    made: dict = {}

    def get(variant: str = "mha", fmt: str = "safetensors"):
        if (variant, fmt) not in made:
            model = make_model(variant)
            directory = tmp_path_factory.mktemp(f"{variant}-{fmt}")
            made[(variant, fmt)] = (model, save(model, directory, fmt))
        return made[(variant, fmt)]

    return get


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory):
    """(hf_model, checkpoint_dir) of a tests/tiny_families.py variant, written once per session."""
    from tiny_families import make_model, save

    made: dict = {}

    def get(variant: str):
        if variant not in made:
            model = make_model(variant)
            made[variant] = (model, save(model, tmp_path_factory.mktemp(variant)))
        return made[variant]

    return get
