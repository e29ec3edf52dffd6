"""One precision and batch size measured: a worker per engine, a warm-up generation each, then
--repeats rounds in which every engine generates once, who goes first rotating. The CPU and
device benchmarks both measure their configurations here.

With compile times asked for, pyhlo first loads once into an empty compile cache (cold), and
its measured worker then loads from that cache (warm). Each finished row carries medians of
TTFT, decode speed and ms per step (stats.decode_metrics), peak RSS, and how many of its leading
greedy tokens equal pyhlo's.
"""
from __future__ import annotations

import pathlib
import shutil
import sys
import tempfile

from tools.bench import stats
from tools.bench.machine import DISTURBED, OtherLoad
from tools.bench.worker import Worker, WorkerError

BUCKET_PROMPT_TOKENS = 16


def new_row(engine: str, amp: str, batch: int) -> dict:
    """An engine's row before it ran: every key of the report's rows (report.py), none filled."""
    return {"engine": engine, "amp": amp, "batch": batch, "status": "ok", "error": None,
            "ttft_ms": None, "decode_tokens_per_s": None, "ms_per_step": None, "load_s": None,
            "compile_cold_s": None, "compile_warm_s": None, "peak_rss_mb": None, "rss_mb": None,
            "cold_peak_rss_mb": None, "roofline_fraction": None, "vs": {}, "ttft_vs": {}, "agreement": None,
            "other_cpu_fraction": [], "disturbed_samples": 0, "info": {}, "warmup_s": None, "total_s": None,
            "tokens": None}


def _fail(row: dict, error: Exception) -> None:
    row["status"], row["error"] = "error", str(error)
    print(f"  {row['engine']} {row['amp']} batch {row['batch']}: {error}", file=sys.stderr)


def measure_config(model_path: pathlib.Path, engines: list[str], amp: str, batch: int, settings: dict,
                   prompts: list[list[int]], model_files: dict[str, pathlib.Path], logs: pathlib.Path,
                   load: OtherLoad, env: dict[str, str] | None = None) -> tuple[list[dict], list[dict]]:
    """Rows of every engine for one precision and batch size, and pyhlo's bucket rows.
    `env`: environment variables for every worker."""
    rows = {e: new_row(e, amp, batch) for e in engines}
    tag = f"{amp}-b{batch}"
    spec = {"amp": amp, "batch": batch, "n_positions": settings["n_positions"],
            "threads": settings["threads"],
            "prompt_tokens": settings["prompt_tokens"], "device": settings.get("device", "cpu"),
            "kv_cache_dtype": settings.get("kv_cache_dtype")}
    new_tokens = settings["new_tokens"]
    cache_env: dict[str, str] = dict(env or {})
    cache_dir = None
    buckets: list[dict] = []
    if settings["compile_times"] and "pyhlo" in rows:
        cache_dir = tempfile.mkdtemp(prefix="pyhlo-bench-cache-")
        cache_env = {"PYHLO_CACHE_DIR": cache_dir}
        print(f"[{tag}] pyhlo: cold to_neuron() into an empty compile cache", file=sys.stderr)
        try:
            with Worker("pyhlo", logs / f"pyhlo-{tag}-cold.log", cache_env) as worker:
                loaded = worker.call("load", engine="pyhlo", model_path=str(model_path), **spec)
                memory = worker.call("memory")
            rows["pyhlo"]["compile_cold_s"] = loaded["seconds"]
            rows["pyhlo"]["cold_peak_rss_mb"] = memory["peak_rss_bytes"] / 2**20
        except WorkerError as error:
            _fail(rows["pyhlo"], error)
    workers: dict[str, Worker] = {}
    try:
        for engine, row in rows.items():
            if row["status"] != "ok":
                continue
            print(f"[{tag}] {engine}: loading", file=sys.stderr)
            worker = Worker(engine, logs / f"{engine}-{tag}.log", cache_env if engine == "pyhlo" else env)
            workers[engine] = worker
            try:
                loaded = worker.call("load", engine=engine, model_path=str(model_files[engine]), **spec)
            except WorkerError as error:
                _fail(row, error)
                continue
            row["load_s"], row["info"] = loaded["seconds"], loaded["info"]
            if engine == "pyhlo" and cache_dir is not None:
                row["compile_warm_s"] = loaded["seconds"]
        live = [e for e in rows if rows[e]["status"] == "ok"]
        warm_tokens: dict[str, list[list[int]]] = {}
        records: dict[str, list[dict]] = {e: [] for e in live}
        for engine in list(live):
            try:
                warm = workers[engine].call("generate", prompts=prompts, new_tokens=new_tokens)
                warm_tokens[engine] = rows[engine]["tokens"] = warm["tokens"]
                rows[engine]["warmup_s"] = warm["total_s"]
            except WorkerError as error:
                _fail(rows[engine], error)
                live.remove(engine)
        for round_ in range(settings["repeats"]):
            print(f"[{tag}] round {round_ + 1}/{settings['repeats']}", file=sys.stderr)
            turn = round_ % max(1, len(live))
            for engine in live[turn:] + live[:turn]:  # who goes first rotates
                if rows[engine]["status"] != "ok":
                    continue
                try:
                    records[engine].append(load.generate(workers[engine], prompts, new_tokens))
                except WorkerError as error:
                    _fail(rows[engine], error)
        for engine in live:
            row = rows[engine]
            if row["status"] == "ok":
                summarize_records(row, records[engine], new_tokens, batch)
                if "pyhlo" in warm_tokens and engine != "pyhlo" and engine in warm_tokens:
                    row["agreement"] = {"reference": "pyhlo", "new_tokens": new_tokens,
                                        "matching_new_tokens": [
                                            stats.matching_prefix(a, b)
                                            for a, b in zip(warm_tokens[engine], warm_tokens["pyhlo"])]}
        if settings["buckets"] and "pyhlo" in live and rows["pyhlo"]["status"] == "ok":
            buckets = measure_buckets(workers["pyhlo"], rows["pyhlo"], prompts, settings, tag, load)
        for engine, worker in workers.items():
            if worker.proc.poll() is None:
                try:
                    memory = worker.call("memory")
                    rows[engine]["peak_rss_mb"] = memory["peak_rss_bytes"] / 2**20
                    rows[engine]["rss_mb"] = memory["rss_bytes"] / 2**20
                except WorkerError:
                    pass
    finally:
        for worker in workers.values():
            worker.close()
        if cache_dir is not None:
            shutil.rmtree(cache_dir, ignore_errors=True)
    return list(rows.values()), buckets


def summarize_records(row: dict, records: list[dict], new_tokens: int, batch: int) -> None:
    """Fill the row's speed summaries and other processes' share from its measured generations."""
    metrics = [stats.decode_metrics(r["ttft_s"], r["total_s"], new_tokens, batch) for r in records]
    row["ttft_ms"] = stats.summarize(m["ttft_ms"] for m in metrics)
    row["decode_tokens_per_s"] = stats.summarize(m["tokens_per_s"] for m in metrics)
    row["ms_per_step"] = stats.summarize(m["ms_per_step"] for m in metrics)
    row["total_s"] = stats.summarize(r["total_s"] for r in records)
    others = [r.get("other_cpu_fraction", 0.0) for r in records]
    row["other_cpu_fraction"] = others
    row["disturbed_samples"] = sum(o > DISTURBED for o in others)


def measure_buckets(worker: Worker, row: dict, prompts: list[list[int]], settings: dict, tag: str,
                    load: OtherLoad) -> list[dict]:
    """One long generation from a short prompt up to n_positions; each step's time goes to the
    token bucket it ran in."""
    buckets = row["info"]["token_buckets"]
    prompt_length = max(1, min(BUCKET_PROMPT_TOKENS, buckets[0] // 2, settings["prompt_tokens"]))
    new_tokens = settings["n_positions"] - prompt_length
    print(f"[{tag}] pyhlo: {new_tokens} decode steps across buckets {buckets}", file=sys.stderr)
    try:
        record = load.generate(worker, [p[:prompt_length] for p in prompts], new_tokens)
    except WorkerError as error:
        print(f"  bucket run failed: {error}", file=sys.stderr)
        return []
    times = record["token_times_s"]
    step_ms = [(b - a) * 1e3 for a, b in zip(times, times[1:])]
    rows = stats.bucket_rows(step_ms, prompt_length, buckets)
    return [{"amp": row["amp"], "batch": row["batch"], **r,
             "other_cpu_fraction": record["other_cpu_fraction"]}
            for r in rows]
