"""The worker protocol: each engine runs in a child process of its own (so memory peaks do not
mix), driven by one JSON request per stdin line and answering one JSON reply per stdout line.

Requests: {"op": "load", "engine": ..., "model_path": ..., and the configuration} -> load
seconds and the engine's info; {"op": "generate", "prompts": ..., "new_tokens": ...} -> a
generation record (peers.generation_record) with the worker's own CPU seconds; {"op":
"memory"} -> peak and current RSS; {"op": "quit"}. A failure is a reply, not an exit: the
parent reports it in the engine's row and goes on.
"""
from __future__ import annotations

import importlib
import json
import os
import pathlib
import subprocess
import sys
import time
import traceback
from typing import Any

from tools.bench import peers, pyhlo_runner

ROOT = pathlib.Path(__file__).resolve().parents[2]


# -- the parent's side -----------------------------------------------------------------
class WorkerError(RuntimeError):
    """A worker's failure, or its exit: the engine's row records it and the run goes on."""


class Worker:
    """One engine in a child process, driven by JSON lines (`python -m tools.bench.worker --worker`)."""

    def __init__(self, name: str, log_path: pathlib.Path, env: dict[str, str] | None = None):
        self.name = name
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        environment = dict(os.environ, TQDM_DISABLE="1", TOKENIZERS_PARALLELISM="false", **(env or {}))
        environment["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT)] + ([environment["PYTHONPATH"]] if environment.get("PYTHONPATH") else []))
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "tools.bench.worker", "--worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, env=environment)

    def call(self, op: str, **request: Any) -> Any:
        try:
            self.proc.stdin.write(json.dumps({"op": op, **request}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            self.proc.wait(timeout=30)
            raise WorkerError(f"{self.name} worker exited with code {self.proc.returncode}: "
                              f"{self._log_tail()}")
        reply = json.loads(line)
        if not reply["ok"]:
            raise WorkerError(f"{self.name}: {reply['error']}")
        return reply["result"]

    def _log_tail(self, lines: int = 5) -> str:
        self._log.flush()
        try:
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            tail = []
        return " | ".join(tail) or f"see {self.log_path}"

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


# -- the child's side ------------------------------------------------------------------
RUNNERS = {"pyhlo": pyhlo_runner.PyhloRunner, "hf": peers.HFRunner, "hf-compiled": peers.HFCompiledRunner,
           "llamacpp": peers.LlamaCppRunner}
# Imported before the load clock starts: library import time is not load time.
PRELOAD = {"pyhlo": ("decoders", "jax"), "hf": ("torch", "transformers"),
           "hf-compiled": ("torch", "transformers"), "llamacpp": ("llama_cpp",)}


def peak_rss_bytes() -> int:
    """This process's resident-set high-water mark.

    /proc's VmHWM belongs to the process's own address space. getrusage's ru_maxrss is no
    good in a worker: Linux carries the parent's peak into it across fork and exec.
    """
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, kB elsewhere


def worker_main() -> int:
    """The child side of Worker: one request per stdin line, one JSON reply per line."""
    import psutil

    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the libraries print goes to the log, not into the replies
    sys.stdout = sys.stderr
    runner = None
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        if op == "quit":
            break
        try:
            if op == "load":
                for module in PRELOAD[request["engine"]]:
                    importlib.import_module(module)
                started = time.perf_counter()
                runner = RUNNERS[request["engine"]](**request)
                result = {"seconds": time.perf_counter() - started, "info": runner.info}
            elif op == "generate":
                cpu = os.times()
                result = runner.generate(request["prompts"], request["new_tokens"])
                done = os.times()
                result["cpu_s"] = done.user + done.system - cpu.user - cpu.system
            elif op == "memory":
                result = {"peak_rss_bytes": peak_rss_bytes(), "rss_bytes": psutil.Process().memory_info().rss}
            else:
                raise ValueError(f"unknown request {op!r}")
            reply = {"ok": True, "result": result}
        except Exception as error:  # noqa: BLE001 - reported to the parent, which goes on
            traceback.print_exc()
            reply = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        replies.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] != ["--worker"]:
        sys.exit("this module is the bench worker; run `pyhlo bench` instead")
    sys.exit(worker_main())
