"""Shared fixtures."""

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of the real SmolLM2-135M-Instruct GGUF, fetched once into the model cache."""
    from decoders.checkpoints.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session", autouse=True)
def _compile_cache_dir(tmp_path_factory):
    """Tests compile into a cache of their own unless PYHLO_CACHE_DIR says otherwise."""
    import os

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
