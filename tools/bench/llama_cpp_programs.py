"""llama.cpp's own programs, `llama-server` and `llama-bench`, for the benchmarks.

They are built once, with cmake, from the llama.cpp source that llama-cpp-python's source
distribution carries (`pip download --no-binary`), tuned for this CPU (GGML_NATIVE), linked
statically, and kept in the model cache. About 20 minutes on 2 cores; `pyhlo bench
--build-llama-cpp` does it. A program already on PATH, or in $PYHLO_LLAMA_CPP_BIN, is used as
it is.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile

LLAMA_CPP_PYTHON = "0.3.36"  # the llama.cpp source is the one this release vendors
PROGRAMS = ("llama-server", "llama-bench")
BIN_ENV = "PYHLO_LLAMA_CPP_BIN"
HOW_TO_BUILD = "pyhlo bench --build-llama-cpp (builds llama-server and llama-bench, about 20 min on 2 cores)"


def cache_bin_dir() -> pathlib.Path:
    from decoders.checkpoints.default_model import default_cache_dir

    return default_cache_dir() / f"llama.cpp-{LLAMA_CPP_PYTHON}" / "bin"


def find(program: str) -> pathlib.Path | None:
    """The program from $PYHLO_LLAMA_CPP_BIN, else the model cache, else PATH; None if nowhere."""
    if program not in PROGRAMS:
        raise ValueError(f"unknown llama.cpp program {program!r}; known: {', '.join(PROGRAMS)}")
    folders = [pathlib.Path(os.environ[BIN_ENV])] if os.environ.get(BIN_ENV) else []
    for folder in folders + [cache_bin_dir()]:
        if (folder / program).is_file() and os.access(folder / program, os.X_OK):
            return folder / program
    found = shutil.which(program)
    return pathlib.Path(found) if found else None


def missing_reason(program: str) -> str | None:
    """None if the program is found, else why not and how to get it."""
    if find(program) is not None:
        return None
    return f"{program} not found (not in ${BIN_ENV}, the model cache or PATH); build it with {HOW_TO_BUILD}"


def _run(command: list[str], cwd: pathlib.Path | None = None) -> None:
    print("+ " + " ".join(command), file=sys.stderr, flush=True)
    subprocess.run(command, cwd=cwd, check=True)


def build(jobs: int | None = None) -> pathlib.Path:
    """Build llama-server and llama-bench into the model cache; returns their folder."""
    if shutil.which("cmake") is None:
        raise RuntimeError("building llama.cpp needs cmake (and a C++ compiler): install them first")
    target = cache_bin_dir()
    jobs = jobs or os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="llama-cpp-build-") as scratch:
        work = pathlib.Path(scratch)
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
              "-d", str(work), f"llama-cpp-python=={LLAMA_CPP_PYTHON}"])
        (sdist,) = work.glob("llama_cpp_python-*.tar.gz")
        with tarfile.open(sdist) as archive:
            archive.extractall(work, filter="data")
        source = work / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
        build_dir = work / "build"
        _run(["cmake", "-S", str(source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release",
              "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_OPENSSL=OFF",
              "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON",
              "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_UI=OFF",
              "-DLLAMA_USE_PREBUILT_UI=OFF"])  # the prebuilt web UI would be fetched from a model hub
        _run(["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs),
              "--target", *PROGRAMS])
        staging = pathlib.Path(tempfile.mkdtemp(dir=_ensure(target.parent), prefix=".bin."))
        os.chmod(staging, 0o755)  # mkdtemp's folder is private; the cache's folders are readable
        for program in PROGRAMS:
            shutil.copy2(build_dir / "bin" / program, staging / program)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    return target


def _ensure(folder: pathlib.Path) -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def server_command(model: pathlib.Path, port: int, slots: int, context_per_slot: int,
                   threads: int) -> list[str]:
    """llama-server on `model`: `slots` sequences decoded together (continuous batching, its
    default), each with `context_per_slot` positions, on loopback."""
    program = find("llama-server")
    if program is None:
        raise RuntimeError(missing_reason("llama-server"))
    return [str(program), "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--parallel", str(slots), "--ctx-size", str(slots * context_per_slot), "--threads", str(threads),
            "--cont-batching", "--no-webui"]
