"""`pyhlo bench --serve`: `pyhlo serve` against llama.cpp's own C++ server (`llama-server`,
8 slots, continuous batching), vLLM's CPU build (tools/bench/vllm_peer.py; on a GGUF file it runs
the file's weights dequantized into an HF directory) and, where asked, llama-cpp-python's server,
on the same weights, each started in a process of its own on a free loopback port, then driven by
1, 4 and 8 concurrent streaming clients through the official `openai` client. Each client sends its share
of the requests one after another (distinct chat prompts, greedy, max_tokens fixed). Reported
per server and concurrency: generated tokens per second over the whole run (the answers' tokens
counted with the model's tokenizer, the same way for every server) and the median and 95th
percentile of the time to first token. A server that is not found is left out, saying how to
get it (llama-server: `pyhlo bench --build-llama-cpp`; vLLM: `pyhlo bench --install-vllm`). On
an HF directory (--model) pyhlo and vLLM run it, and llama.cpp's servers, which read GGUF files
only, are left out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tools.bench import llama_cpp_programs, peers, vllm_peer
from tools.bench.machine import machine_info
from tools.bench.settings import csv, default_or_given_model

# Servers --serve can drive; llamacpp is llama-cpp-python's server (one request at a time);
# pyhlo-x8 is pyhlo serve rounding the activations of a GGUF's block products to int8 per 32
# values (--int8-activations), the arithmetic llama.cpp's servers use.
SERVERS = ("pyhlo", "pyhlo-x8", "llama-server", "llamacpp", "vllm")
PYHLO_SERVERS = ("pyhlo", "pyhlo-x8")
DEFAULT_SERVERS = "pyhlo,llama-server"             # and vllm, where it is installed
GGUF_ONLY = ("llama-server", "llamacpp")
SLOTS = 8
SETUPS = {"pyhlo": f"pyhlo serve with {SLOTS} lines",
          "pyhlo-x8": f"pyhlo serve --int8-activations with {SLOTS} lines",
          "llama-server": f"llama-server with {SLOTS} slots",
          "llamacpp": "llama-cpp-python's server (one request at a time)",
          "vllm": f"vLLM (f32) with {SLOTS} sequences at most"}

TOPICS = ["the sea", "a cat", "winter", "coffee", "the moon", "trains", "music", "bread", "rain", "a garden",
          "mountains", "a library", "fire", "the desert", "bees", "a clock", "rivers", "a lighthouse", "snow",
          "the city", "tea", "a bridge", "stars", "a forest"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_ready(base: str, process: subprocess.Popen, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode}")
        try:
            if httpx.get(base + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not answer within {timeout:.0f} s")


def start(engine: str, model: Path, lines: int, context: int, threads: int,
          log: Path, kv_cache_dtype: str | None = None) -> tuple[subprocess.Popen, str]:
    """`engine`'s server on a free port, ready; kv_cache_dtype: pyhlo serve's caches' type."""
    port = _free_port()
    env = dict(os.environ)
    if engine in PYHLO_SERVERS:
        command = [sys.executable, "-m", "tools.cli", "serve", str(model), "--port", str(port),
                   "--batch-size", str(lines), "--n-positions", str(context)]
        if engine == "pyhlo-x8":
            command.append("--int8-activations")
        if kv_cache_dtype:
            command += ["--kv-cache-dtype", kv_cache_dtype]
    elif engine == "llama-server":
        command = llama_cpp_programs.server_command(model, port, lines, context, threads)
    elif engine == "vllm":
        # f32, as pyhlo serve runs an HF directory by default and as a GGUF file's converted folder holds it
        command, env = vllm_peer.server_command(vllm_peer.hf_directory(model), port, lines, context,
                                                "float32", threads)
    else:
        command = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--port", str(port),
                   "--host", "127.0.0.1", "--n_ctx", str(context), "--n_threads", str(threads),
                   "--n_batch", "512", "--interrupt_requests", "False"]
    log.parent.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT,
                               cwd=Path(__file__).resolve().parents[2], env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base, process, timeout=vllm_peer.STARTUP_S if engine == "vllm" else 600)
    except RuntimeError:
        process.kill()
        raise
    return process, base


async def _drive(base: str, clients: int, requests: int,
                 max_tokens: int) -> tuple[list[float], list[str], float]:
    from openai import AsyncOpenAI

    # A connection the server closed between two requests (llama-server closes idle keep-alive
    # connections) fails before any byte of an answer: the client sends the request again, as a
    # client in production does (openai's retries: connection failures, 429 and 5xx answers; a
    # stream that has begun is not sent again).
    async with AsyncOpenAI(base_url=base + "/v1", api_key="none", timeout=600, max_retries=2) as api:
        return await _clients(api, clients, requests, max_tokens)


async def _clients(api, clients: int, requests: int, max_tokens: int) -> tuple[list[float], list[str], float]:
    model = (await api.models.list()).data[0].id
    first_token, texts = [], []

    async def client(index: int) -> None:
        for number in range(index, requests, clients):
            question = f"Write two sentences about {TOPICS[number % len(TOPICS)]}."
            sent = time.perf_counter()
            stream = await api.chat.completions.create(model=model,
                                                       messages=[{"role": "user", "content": question}],
                                                       max_tokens=max_tokens, temperature=0, stream=True)
            pieces, seen = [], False
            async for chunk in stream:
                piece = chunk.choices[0].delta.content if chunk.choices else None
                if piece and not seen:
                    first_token.append(time.perf_counter() - sent)
                    seen = True
                pieces.append(piece or "")
            texts.append("".join(pieces))

    started = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    return first_token, texts, time.perf_counter() - started


def measure(model: Path, engines: list[str], concurrency: list[int], requests: int, max_tokens: int,
            threads: int, out: Path, failed: dict[str, str] | None = None,
            kv_cache_dtype: str | None = None) -> list[dict]:
    """One row per engine and concurrency. A server that fails (does not start, drops a
    connection, streams no text) is recorded in `failed` with the reason, and the others run."""
    from decoders.checkpoints import open_checkpoint

    tokenizer = open_checkpoint(model).tokenizer()
    rows = []
    for engine in engines:
        try:
            rows += _measure_one(engine, model, concurrency, requests, max_tokens, threads, out, tokenizer,
                                 kv_cache_dtype)
        except Exception as error:                   # one server's failure leaves the others' rows
            if failed is None:
                raise
            failed[engine] = f"{type(error).__name__}: {error}"
            print(f"[serve] {engine}: failed: {failed[engine]}", file=sys.stderr, flush=True)
    return rows


def _measure_one(engine: str, model: Path, concurrency: list[int], requests: int, max_tokens: int,
                 threads: int, out: Path, tokenizer: Any, kv_cache_dtype: str | None = None) -> list[dict]:
    rows = []
    print(f"[serve] {engine}: starting", file=sys.stderr, flush=True)
    log = out / "logs" / f"serve-{engine}.log"
    process, base = start(engine, model, max(concurrency), 1024, threads, log,
                          kv_cache_dtype if engine in PYHLO_SERVERS else None)
    try:
        asyncio.run(_drive(base, 1, 1, 8))                     # warm-up
        for clients in concurrency:
            print(f"[serve] {engine}: {clients} clients", file=sys.stderr, flush=True)
            ttft, texts, seconds = asyncio.run(_drive(base, clients, requests, max_tokens))
            if not ttft:
                raise RuntimeError(f"it streamed no text in {len(texts)} requests (see {log})")
            tokens = sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts)
            ordered = sorted(ttft)
            rows.append({"engine": engine, "clients": clients, "requests": len(texts), "tokens": tokens,
                         "seconds": seconds, "tokens_per_s": tokens / seconds,
                         "ttft_p50_ms": 1e3 * statistics.median(ordered),
                         "ttft_p95_ms": 1e3 * ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]})
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
    return rows


def resolve_servers(requested: str | None, model: Path | None = None) -> tuple[list[str], dict[str, str]]:
    """The servers to drive on `model`, and the ones left out with the reason."""
    names = csv(requested or DEFAULT_SERVERS)
    for name in names:
        if name not in SERVERS:
            raise ValueError(f"--serve --engines {name!r} is not one of {', '.join(SERVERS)}")
    missing_vllm = vllm_peer.missing_reason()
    if requested is None and missing_vllm is None:
        names.append("vllm")
    reasons = {"llama-server": llama_cpp_programs.missing_reason("llama-server"),
               "llamacpp": peers.llamacpp_available(), "vllm": missing_vllm}
    if model is not None and model.suffix != ".gguf":
        reasons.update({name: f"it reads .gguf files only, and {model.name} is an HF directory (give a .gguf "
                              "--model to compare with it)" for name in GGUF_ONLY})
        reasons["pyhlo-x8"] = (f"int8 activations apply to a GGUF file's block weights, and {model.name} is "
                               "an HF directory")
    unavailable = {n: reasons[n] for n in names if reasons.get(n)}
    return [n for n in names if n not in unavailable], unavailable


def table(rows: list[dict]) -> str:
    """Markdown rows per server and concurrency; pyhlo's rows give its ratio to llama-server (or,
    without it, llama-cpp-python's server) and to vLLM. Rows that name their weights get a column
    for them."""
    anchor = next((e for e in ("llama-server", "llamacpp") if any(r["engine"] == e for r in rows)), None)
    anchors = [e for e in (anchor, "vllm") if e and any(r["engine"] == e for r in rows)] or ["llama.cpp"]
    weights = any("weights" in r for r in rows)
    lines = ["| server | " + ("weights | " if weights else "") + "clients | requests | tokens | tok/s | "
             "TTFT p50 ms | TTFT p95 ms | " + "".join(f"pyhlo vs {a} tok/s | " for a in anchors).rstrip(),
             "|---|" + ("---|" if weights else "") + "---|---|---|---|---|---|" + "---|" * len(anchors)]
    rates = {a: {r["clients"]: r["tokens_per_s"] for r in rows if r["engine"] == a} for a in anchors}
    for r in rows:
        ratios = [f"{r['tokens_per_s'] / rates[a][r['clients']]:.2f}x"
                  if r["engine"] in PYHLO_SERVERS and r["clients"] in rates[a] else "" for a in anchors]
        lines.append(f"| {r['engine']} | " + (f"{r.get('weights', '')} | " if weights else "")
                     + f"{r['clients']} | {r['requests']} | {r['tokens']} | {r['tokens_per_s']:.1f} | "
                     f"{r['ttft_p50_ms']:.0f} | {r['ttft_p95_ms']:.0f} | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def weights(engine: str, model: Path) -> str:
    """What `engine` runs of `model`, for the table: a GGUF file as stored (vLLM: dequantized), an
    HF directory in f32 (pyhlo serve's default, and the dtype vLLM is given)."""
    if model.suffix != ".gguf":
        return f"{model.name} in f32"
    return f"{model.name} dequantized, f32 safetensors" if engine == "vllm" else f"{model.name} as stored"


def run(args: argparse.Namespace) -> int:
    """`pyhlo bench --serve`: measure, print the table, write serve.md and serve.json."""
    model_path = default_or_given_model(args)
    engines, unavailable = resolve_servers(args.engines, model_path)
    out = Path(args.out)
    failed: dict[str, str] = {}
    caches = getattr(args, "kv_cache_dtype", None)
    rows = measure(model_path, engines, [1, 4, SLOTS], args.serve_requests, args.new_tokens or 64,
                   args.threads, out, failed, caches)
    for row in rows:
        row["weights"] = weights(row["engine"], model_path)
    info = machine_info()
    text = (f"Serving: {model_path.name}, {args.serve_requests} chat requests per level, "
            f"max_tokens {args.new_tokens or 64}, greedy, streamed; "
            + ", ".join(SETUPS[e] for e in engines if e in SETUPS) + "; "
            + (f"pyhlo's KV caches {caches}; " if caches else "")
            + f"CPU {info.get('cpu')}, {args.threads} threads\n\n" + table(rows))
    for engine, why in unavailable.items():
        text += f"\n\n{engine} left out: {why}"
    for engine, why in failed.items():
        text += f"\n\n{engine} failed: {why}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.md").write_text(text + "\n")
    (out / "serve.json").write_text(json.dumps(rows, indent=1))
    print(text)
    return 0
