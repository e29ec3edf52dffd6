"""The compiled programs of one model: built by key, compiled through the cache, run by name.

Buckets compile in parallel with a progress bar; programs needed only by rare inputs
(long-prompt chunks, sampler variants) compile on first use.
"""
from __future__ import annotations

import hashlib
import json
import logging
import pathlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from decoders.programs.builder import Program, ProgramBuilder
from decoders.programs.keys import ProgramKey
from runtime.placement import Replicas

log = logging.getLogger("pyhlo")


@dataclass
class CompiledProgram:
    program: Program
    executable: Any
    seconds: float
    from_cache: bool
    checked: bool = False

    def arguments(self, values: Mapping[str, Any]) -> list[Any]:
        """Arguments in parameter order, from a name -> buffer mapping."""
        return [values[name] for name in self.program.param_names]

    @property
    def replicas(self) -> int:
        return getattr(self.executable, "num_replicas", 1)

    def _run_replicated(self, args: list[Any]) -> list[Any]:
        """Every replica runs with its own buffer of each `Replicas` argument (the same array
        for the others); output i comes back as Replicas. Across several processes this
        process runs its own replicas: the others' inputs are not made, their outputs are None."""
        local = getattr(self.executable, "local_replicas", range(self.replicas))
        per_replica: list[Any] = [None] * self.replicas
        for r in local:
            per_replica[r] = [a[r] if isinstance(a, Replicas) else a for a in args]
        outputs = self.executable.run_replicated(per_replica)
        count = len(next(out for out in outputs if out is not None))
        return [Replicas(None if out is None else out[i] for out in outputs) for i in range(count)]

    def run(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """Run with arguments by name (numpy arrays or device buffers, checked); outputs by name."""
        args = self.arguments(values)
        outputs = self._run_replicated(args) if self.replicas > 1 else self.executable.run(args)
        return dict(zip(self.program.outputs, outputs))

    def run_checked_once(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """run(), whose checks only the first call pays: later calls must pass device buffers of
        the same shapes (a decode step's arguments: weights, caches, step inputs)."""
        if not self.checked or self.replicas > 1:
            self.checked = True
            return self.run(values)
        return dict(zip(self.program.outputs, self.executable.run_buffers(self.arguments(values))))

    def run_buffers(self, args: list[Any]) -> list[Any]:
        """Device buffers in parameter order, unchecked; outputs in `program.outputs` order
        (the per-layer hot loop, whose arguments were checked once through run())."""
        if self.replicas > 1:
            return self._run_replicated(args)
        return self.executable.run_buffers(args)


def _module_hash(program: Program) -> str:
    return hashlib.sha256(program.module.SerializeToString()).hexdigest()


def compile_workers(backend: Any, wanted: int | None) -> int:
    """How many programs compile at once: `wanted` (NeuronConfig.compilation_worker_count), else
    2; one where the backend cannot compile in parallel (it would crash), whatever was asked."""
    if not getattr(backend, "parallel_compiles_safe", True):
        if wanted and wanted > 1:
            log.warning("compilation_worker_count=%d: %s compiles one program at a time (parallel compiles "
                        "crash its compiler)", wanted, getattr(backend, "platform", backend))
        return 1
    return wanted or 2


class ProgramSet:
    def __init__(self, builder: ProgramBuilder, backend: Any, workers: int | None = None):
        self.builder = builder
        self.backend = backend
        self.replicas = builder.tp_degree
        self.workers = compile_workers(backend, workers)
        self.compiled: dict[ProgramKey, CompiledProgram] = {}
        self.saved: dict[str, tuple[str, pathlib.Path]] = {}
        self.cache_hits = 0
        self.compiler_calls = 0
        self.loaded_from_save = 0
        self._cache = None

    @property
    def cache(self):
        if self._cache is None:
            from runtime.compile_cache import CompileCache

            self._cache = CompileCache()
        return self._cache

    def build(self, key: ProgramKey) -> Program:
        return key.build(self.builder)

    def _saved_file(self, program: Program) -> pathlib.Path | None:
        """The file a save() wrote for this very program (same HLO), or None."""
        saved = self.saved.get(program.name)
        return saved[1] if saved is not None and saved[0] == _module_hash(program) else None

    def _compile(self, program: Program) -> CompiledProgram:
        started = time.perf_counter()
        module_bytes = program.module.SerializeToString()
        saved_file = self._saved_file(program)
        if saved_file is not None:
            try:
                executable = self.backend.deserialize(saved_file.read_bytes(), module_bytes,
                                                      num_replicas=self.replicas)
            except Exception as err:     # XLA's own message names no file
                raise ValueError(f"{saved_file} could not be loaded ({type(err).__name__}: {err}); the saved "
                                 f"directory is damaged: save the model again (model.save())") from err
            self.loaded_from_save += 1
            return CompiledProgram(program, executable, time.perf_counter() - started, True)
        executable, hit = self.cache.get_or_compile(self.backend, module_bytes, num_replicas=self.replicas)
        return CompiledProgram(program, executable, time.perf_counter() - started, hit)

    def _record(self, key: ProgramKey, compiled: CompiledProgram) -> None:
        self.compiled[key] = compiled
        if compiled.from_cache:
            self.cache_hits += 1
        else:
            self.compiler_calls += 1

    def get(self, key: ProgramKey) -> CompiledProgram:
        if key not in self.compiled:
            program = self.build(key)
            log.info("compiling %s on first use", program.name)
            self._record(key, self._compile(program))
        return self.compiled[key]

    def _cached(self, program: Program) -> bool:
        """Whether `program` comes from a save() or the compile cache rather than the compiler."""
        if self._saved_file(program) is not None:
            return True
        return self.cache.holds(self.backend, program.module.SerializeToString(), num_replicas=self.replicas)

    def compile_all(self, keys: Iterable[ProgramKey]) -> None:
        from tqdm.auto import tqdm

        todo = [k for k in dict.fromkeys(keys) if k not in self.compiled]
        with ThreadPoolExecutor(max_workers=self.workers) as pool, tqdm(
            total=len(todo), desc="compiling", unit="program", disable=None
        ) as bar:
            # Each program goes to the pool as soon as it is built: the next one is built (in
            # Python) while the first compiles or loads from the cache (in XLA).
            futures, new = {}, 0
            for key in todo:
                program = self.build(key)
                new += not self._cached(program)
                futures[key] = pool.submit(self._compile, program)
            if new:
                logging.getLogger("pyhlo.progress").info(
                    "compiling %d program%s (once: the compile cache keeps them) ...", new, "s" * (new > 1))
            for key, future in futures.items():
                self._record(key, future.result())
                bar.update(1)

    # -- save / load --------------------------------------------------------------
    def save(self, directory: pathlib.Path) -> None:
        folder = directory / "programs"
        folder.mkdir(parents=True, exist_ok=True)
        manifest = {}
        for compiled in self.compiled.values():
            name = compiled.program.name
            (folder / f"{name}.pb").write_bytes(compiled.program.module.SerializeToString())
            (folder / f"{name}.exe").write_bytes(compiled.executable.serialize())
            manifest[name] = _module_hash(compiled.program)
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))

    def load(self, directory: pathlib.Path) -> None:
        folder = directory / "programs"
        if not (folder / "manifest.json").exists():
            raise ValueError(f"{directory} has no programs/manifest.json: its save did not finish; save the "
                             f"model again (model.save())")
        manifest = json.loads((folder / "manifest.json").read_text())
        self.saved = {name: (digest, folder / f"{name}.exe") for name, digest in manifest.items()}
