"""The reports of `pyhlo bench` and `pyhlo bench --device`: one assembly for both, then
markdown, JSON and (CPU) a PNG.

Pure over the rows the runs measured (no timing, no models), so it is tested on made-up rows.
A result row is a dict with these keys (rounds.new_row):

    engine, amp ("f32" | "bf16" | "s8" | "gguf" | "gguf-x8"), batch, status ("ok" | "unavailable" | "error"),
    error, ttft_ms, decode_tokens_per_s, ms_per_step     summaries: {median, min, max, n, samples}
    load_s, compile_cold_s, compile_warm_s, peak_rss_mb, cold_peak_rss_mb, rss_mb
    roofline_fraction, vs ({peer: decode ratio}), ttft_vs ({peer: TTFT ratio}),
    agreement ({reference, matching_new_tokens: [per line], new_tokens}),
    other_cpu_fraction ([per sample: share of the CPUs other processes took]), disturbed_samples, info,
    warmup_s (the warm-up generation's wall time), total_s (summary of the measured generations' wall time),
    tokens (the warm-up generation's new token ids, per line)

The device benchmark's rows add `compile_s`, and their `roofline_fraction` is measured against
the device's floor. The two reports (JSON schemas `pyhlo-bench/1` and `pyhlo-bench-device/1`)
differ in their per-precision weight section: `roofline` (least ms per step, most tokens/s) for
the CPU, `floor` (floor ms) for a device; the CPU report adds `buckets`.
"""
from __future__ import annotations

import datetime
import json
import math
import pathlib
from typing import Any, Callable, Sequence

from tools.bench.machine import DISTURBED, RETRIES, machine_info
from tools.bench.stats import median_of, prefill_rate, ratio, roofline_fraction, roofline_ms

SCHEMA = "pyhlo-bench/1"
DEVICE_SCHEMA = "pyhlo-bench-device/1"
ENGINE_LABELS = {"pyhlo": "pyhlo", "hf": "HF transformers", "hf-compiled": "HF static cache + torch.compile",
                 "llamacpp": "llama.cpp"}
PEERS = ("hf", "hf-compiled", "llamacpp")
TABLE_COLUMNS = (
    "engine", "amp", "batch", "TTFT ms", "prefill tok/s", "prefill % of f32 GEMM", "decode tok/s", "ms/step",
    "roofline", "vs HF", "vs llama.cpp", "load s", "peak RSS MB", "same tokens",
)
DEVICE_TABLE_COLUMNS = ("engine", "amp", "batch", "TTFT ms", "decode tok/s", "ms/step", "% of floor",
                        "compile s", "same tokens")
# The peers pyhlo's decode speed is given against in the device report, in its order.
DEVICE_RATIO_PEERS = ("hf-compiled", "hf")
BUCKET_COLUMNS = ("amp", "batch", "bucket", "steps", "ms/step", "vs largest bucket")
COMPILE_COLUMNS = ("amp", "batch", "cold to_neuron s", "warm to_neuron s", "cold peak RSS MB")
# Leading greedy tokens two engines must share in f32 before we call the weights the same.
AGREEMENT_TOKENS = 16
# What a precision means for each engine, where the name alone does not say it.
AMP_NOTES = {
    "s8": "s8: int8 weights for the decoder layers' linear products, embeddings, LM head and norms f32 "
          "(pyhlo: one f32 scale per row, a prompt's activations rounded to int8 per 32 values for its "
          "integer GEMM (NeuronConfig(int8_activations=True)), decode steps' kept f32; llama.cpp: Q8_0, "
          "one f16 scale per 32 values, activations rounded per 32; HF transformers: torch dynamic int8 "
          "quantization of the layers' Linear modules, activations quantized per product); vs compares "
          "engines at the same precision. The three round differently, so their greedy tokens part from "
          "pyhlo's sooner than in f32.",
    "gguf": "gguf: the GGUF file's own weights as stored ({model}, in the types it was written in); pyhlo "
            "runs the blocks as stored, dequantized inside its kernels, llama.cpp reads the same file (and "
            "quantizes the activations to 8 bits for its products).",
    "gguf-x8": "gguf-x8: the same file, with pyhlo's kernels rounding the activations of the block products "
               "to int8 per 32 values (K-quants per 256) and multiplying integers "
               "(NeuronConfig(int8_activations=True)), as "
               "llama.cpp does; llama.cpp's row is the same as gguf's, run again.",
}


# -- rows against each other -------------------------------------------------------
def add_roofline_fractions(rows: list[dict], weight_bytes: dict[str, float],
                           bandwidth_bytes_per_s: float) -> None:
    """Fill each ok row's `roofline_fraction` from its amp's weight bytes (weight_bytes[amp])
    and its median ms per step."""
    for row in rows:
        if row["status"] == "ok":
            row["roofline_fraction"] = roofline_fraction(weight_bytes[row["amp"]], bandwidth_bytes_per_s,
                                                         median_of(row["ms_per_step"]))


def add_prefill_rates(rows: list[dict], prompt_tokens: int, flops_per_token: dict[str, float],
                      matmul_gflop_per_s: float | None) -> None:
    """Fill each ok row's `prefill_tokens_per_s` (from its TTFT) and `prefill_gemm_fraction`:
    its FLOP rate (flops_per_token[amp] per prompt token) over the measured f32 GEMM rate."""
    for row in rows:
        if row["status"] != "ok":
            continue
        row["prefill_tokens_per_s"] = prefill_rate(row["ttft_ms"], prompt_tokens, row["batch"])
        rate = median_of(row["prefill_tokens_per_s"])
        flops = flops_per_token.get(row["amp"])
        row["prefill_gemm_fraction"] = (rate * flops / (matmul_gflop_per_s * 1e9)
                                        if rate and flops and matmul_gflop_per_s else None)


def add_comparisons(rows: list[dict]) -> None:
    """Fill each ok row's `vs` (decode tok/s ratio) and `ttft_vs` against every peer's row
    of the same amp and batch."""
    by_key = {(r["engine"], r["amp"], r["batch"]): r for r in rows if r.get("status") == "ok"}
    for row in rows:
        row.setdefault("vs", {})
        row.setdefault("ttft_vs", {})
        if row.get("status") != "ok":
            continue
        for peer in PEERS:
            other = by_key.get((peer, row["amp"], row["batch"]))
            if other is None or other is row:
                continue
            row["vs"][peer] = ratio(median_of(row["decode_tokens_per_s"]),
                                    median_of(other["decode_tokens_per_s"]))
            row["ttft_vs"][peer] = ratio(median_of(row["ttft_ms"]), median_of(other["ttft_ms"]))

# -- the report's dict -----------------------------------------------------------------
def roofline_entry(weight_bytes: int, bandwidth_bytes_per_s: float) -> dict:
    """The CPU report's line for one precision: the least ms a decode step can take."""
    least = roofline_ms(weight_bytes, bandwidth_bytes_per_s)
    return {"weight_bytes": weight_bytes, "min_ms_per_step": least, "max_tokens_per_s_batch1": 1e3 / least}


def floor_entry(weight_bytes: int, bandwidth_bytes_per_s: float) -> dict:
    """The device report's line for one precision: the floor ms of a decode step."""
    return {"weight_bytes": weight_bytes, "floor_ms": roofline_ms(weight_bytes, bandwidth_bytes_per_s)}


# Per schema: the name of the per-precision weight section, and its entries.
WEIGHT_SECTIONS: dict[str, tuple[str, Callable[[int, float], dict]]] = {
    SCHEMA: ("roofline", roofline_entry), DEVICE_SCHEMA: ("floor", floor_entry)}


def assemble(schema: str, machine: dict, workload: dict, bandwidth: dict, weight_bytes: dict[str, int],
             results: list[dict], other_load: list[dict], settings: dict, notes: Sequence[str] = (),
             buckets: list[dict] | None = None, prefill: dict | None = None) -> dict:
    """A run's report: each ok row's share of the bandwidth floor and its ratios to the peers filled
    in, the weight section of `schema`, and the notes a reader should not miss after `notes`.
    `weight_bytes[amp]`: bytes a decode step reads; `buckets`: the CPU run's bucket rows;
    `prefill`: {"flops_per_token", "matmul"} for the prefill columns (add_prefill_rates)."""
    bytes_per_s = bandwidth["gb_per_s"] * 1e9
    section, entry = WEIGHT_SECTIONS[schema]
    add_roofline_fractions(results, weight_bytes, bytes_per_s)
    add_comparisons(results)
    if prefill is not None:
        flops = {amp: prefill["flops_per_token"] for amp in weight_bytes}
        add_prefill_rates(results, workload["prompt_tokens"], flops, prefill["matmul"]["gflop_per_s"])
    report = {
        "schema": schema,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine,
        "workload": workload,
        "bandwidth": bandwidth,
        section: {amp: entry(size, bytes_per_s) for amp, size in weight_bytes.items()},
        "results": results,
    }
    if buckets is not None:
        report["buckets"] = buckets
    if prefill is not None:
        report["prefill"] = prefill
    report["other_load"] = other_load
    report["notes"] = [*notes, *notes_for(results, settings), *busy_notes(other_load)]
    return report


# -- notes -------------------------------------------------------------------------------
LLAMACPP_WITHOUT_AMX = ("CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON "
                        "-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF "
                        "-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF\" pip install --force-reinstall --no-deps "
                        "--no-cache-dir llama-cpp-python")


def notes_for(results: list[dict], settings: dict) -> list[str]:
    """Things a reader should not miss: disagreeing tokens, precisions slower than expected."""
    notes = []
    need = min(AGREEMENT_TOKENS, settings["new_tokens"])
    by_key = {(r["engine"], r["amp"], r["batch"]): r for r in results if r["status"] == "ok"}

    def agreeing(row: dict | None) -> int | None:
        return min(row["agreement"]["matching_new_tokens"]) if row and row.get("agreement") else None

    for (engine, amp, batch), row in by_key.items():
        same = agreeing(row)
        if amp != "f32" or same is None or same >= need:
            continue
        label = ENGINE_LABELS.get(engine, engine)
        single = agreeing(by_key.get((engine, amp, 1)))
        if batch > 1 and single is not None and single >= need:
            notes.append(f"{label} f32 batch {batch}: greedy tokens part from pyhlo's after {same} (worst "
                         f"line) while batch 1 agrees for {single}: its batched kernels round differently "
                         "and a near-tie flips")
        else:
            notes.append(f"{label} f32 batch {batch}: only {same} leading greedy tokens equal pyhlo's "
                         f"(expected >= {need}); are the weights the same?")
    fewer_bytes = {"bf16": "half the weight bytes", "s8": "int8 layer weights"}
    for (engine, amp, batch), row in by_key.items():
        f32 = by_key.get((engine, "f32", batch))
        if amp in fewer_bytes and f32 is not None:
            fast = median_of(f32["decode_tokens_per_s"])
            slow = median_of(row["decode_tokens_per_s"])
            if fast and slow and slow < 0.9 * fast:
                notes.append(f"{ENGINE_LABELS.get(engine, engine)} batch {batch}: {amp} decodes at "
                             f"{slow:.1f} tok/s, f32 at {fast:.1f} tok/s ({fast / slow:.2f}x slower in "
                             f"{amp}, although it reads {fewer_bytes[amp]})")
    crashed = [r for r in results if r["engine"] == "llamacpp" and "code -11" in str(r.get("error", ""))]
    if crashed and "amx_int8" in machine_info().get("cpu_flags", ()):
        notes.append("llama.cpp crashed (SIGSEGV) on this CPU: a llama-cpp-python built with -march=native "
                     "runs its AMX int8 kernels for prompts of 2 or more tokens, and they fault here. Build "
                     "it without them: " + LLAMACPP_WITHOUT_AMX)
    for row in results:
        if row.get("disturbed_samples"):
            notes.append(f"{ENGINE_LABELS.get(row['engine'], row['engine'])} {row['amp']} batch "
                         f"{row['batch']}: {row['disturbed_samples']} of {len(row['other_cpu_fraction'])} "
                         f"samples ran while other processes took over {DISTURBED:.0%} of the CPUs (after "
                         f"{RETRIES} retries)")
        if (row.get("roofline_fraction") or 0) > 1.0:
            notes.append(f"{ENGINE_LABELS.get(row['engine'], row['engine'])} {row['amp']} batch "
                         f"{row['batch']} beats the roofline ({row['roofline_fraction'] * 100:.0f}%): the "
                         "bandwidth probes read slower than the engine did")
    for row in results:
        if row["status"] != "ok":
            notes.append(f"{row['engine']} {row['amp']} batch {row['batch']}: {row['status']}: "
                         f"{row['error']}")
    return notes


def busy_notes(busy: list[dict]) -> list[str]:
    """Configurations whose generations started while other processes kept the CPUs busy."""
    return [f"{b['amp']} batch {b['batch']}: {b['busy_starts']} generations started while other processes "
            f"kept the CPUs busy (after waiting --quiet-wait seconds)" for b in busy if b["busy_starts"]]


# -- formatting --------------------------------------------------------------------
def _num(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:,.{digits}f}"


def spread(summary: dict | None, digits: int = 1) -> str:
    """`median (min–max)`, or just the median when there was one sample."""
    if summary is None:
        return "–"
    if summary["n"] == 1:
        return _num(summary["median"], digits)
    return (f"{_num(summary['median'], digits)} "
            f"({_num(summary['min'], digits)}–{_num(summary['max'], digits)})")


def _times(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def _percent(value: float | None) -> str:
    return "–" if value is None else f"{value * 100:.0f}%"


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def agreement_cell(row: dict) -> str:
    """The 'same tokens' cell: the fewest matching new tokens of any line / new tokens ('–': not compared)."""
    agreement = row.get("agreement")
    if not agreement:
        return "–"
    return f"{min(agreement['matching_new_tokens'])}/{agreement['new_tokens']}"


def rows_table(columns: Sequence[str], rows: Sequence[dict], cells: Callable[[dict], list]) -> str:
    """One line per row: engine, amp and batch, then `cells(row)` for an ok row, or its status and
    error across the rest for one that did not run."""
    lines = []
    for row in rows:
        label = ENGINE_LABELS.get(row["engine"], row["engine"])
        if row.get("status") != "ok":
            reason = row.get("error") or row.get("status")
            lines.append([label, row["amp"], row["batch"], f"{row.get('status')}: {reason}"]
                         + ["–"] * (len(columns) - 4))
        else:
            lines.append([label, row["amp"], row["batch"], *cells(row)])
    return markdown_table(columns, lines)


def results_table(rows: Sequence[dict]) -> str:
    """The CPU report's table: speed, roofline share, ratios to HF and llama.cpp, load, memory."""
    return rows_table(TABLE_COLUMNS, rows, lambda row: [
        spread(row["ttft_ms"]), spread(row.get("prefill_tokens_per_s")),
        _percent(row.get("prefill_gemm_fraction")), spread(row["decode_tokens_per_s"]),
        spread(row["ms_per_step"], 2), _percent(row.get("roofline_fraction")),
        _times(row["vs"].get("hf")), _times(row["vs"].get("llamacpp")), _num(row.get("load_s")),
        _num(row.get("peak_rss_mb"), 0), agreement_cell(row),
    ])


def device_results_table(rows: Sequence[dict]) -> str:
    """The device report's table: speed, share of the floor, compile seconds."""
    compile_s = lambda row: "–" if row.get("compile_s") is None else f"{row['compile_s']:.1f}"  # noqa: E731
    return rows_table(DEVICE_TABLE_COLUMNS, rows, lambda row: [
        spread(row["ttft_ms"]), spread(row["decode_tokens_per_s"]), spread(row["ms_per_step"], 2),
        _percent(row.get("roofline_fraction")), compile_s(row), agreement_cell(row),
    ])


def bucket_table(buckets: Sequence[dict]) -> str:
    cells = [[b["amp"], b["batch"], b["bucket"], b["ms_per_step"]["n"], spread(b["ms_per_step"], 2),
              _times(b.get("vs_largest"))] for b in buckets]
    return markdown_table(BUCKET_COLUMNS, cells)


def compile_table(rows: Sequence[dict]) -> str:
    cells = [[r["amp"], r["batch"], _num(r.get("compile_cold_s")), _num(r.get("compile_warm_s")),
              _num(r.get("cold_peak_rss_mb"), 0)]
             for r in rows if r["engine"] == "pyhlo" and r.get("compile_cold_s") is not None]
    return markdown_table(COMPILE_COLUMNS, cells) if cells else ""


def machine_lines(machine: dict) -> list[str]:
    versions = ", ".join(f"{k} {v}" for k, v in machine.get("versions", {}).items())
    return [
        f"- CPU: {machine.get('cpu', '?')}, {machine.get('cores', '?')} logical cores; "
        f"memory {_num(machine.get('memory_gib'))} GiB; {machine.get('platform', '')}",
        f"- versions: {versions}",
    ]


def report_markdown(report: dict) -> str:
    """The whole report as markdown (what `pyhlo bench` prints)."""
    w = report["workload"]
    out = [
        "# pyhlo bench",
        "",
        f"Model {w['model']}; prompt {w['prompt_tokens']} tokens, {w['new_tokens']} new tokens "
        f"(greedy, EOS ignored); n_positions {w['n_positions']}; repeats: {w['repeats']} after a "
        f"warm-up, engines taking turns; threads: {w['threads']}.",
        "",
        *machine_lines(report["machine"]),
    ]
    bw = report.get("bandwidth")
    if bw:
        probes = ", ".join(f"{name} {rate:.1f}" for name, rate in bw.get("probes_gb_per_s", {}).items())
        runs = bw.get("all_probes_gb_per_s", [])
        out.append(f"- memory read bandwidth: {bw['gb_per_s']:.1f} GB/s ({bw['method']}, median of "
                   f"{len(bw['samples_gb_per_s'])} passes over {bw['array_mb']} MB; probes: {probes} GB/s; "
                   f"best of {len(runs)} measurements through the run: "
                   f"{', '.join(f'{r:.1f}' for r in runs)})")
        for amp, roof in report.get("roofline", {}).items():
            out.append(f"- roofline {amp}: {_num(roof['weight_bytes'] / 1e6, 1)} MB of weights per step -> "
                       f"at least {roof['min_ms_per_step']:.2f} ms per step "
                       f"(at most {roof['max_tokens_per_s_batch1']:.0f} tokens/s at batch 1)")
    prefill = report.get("prefill")
    if prefill:
        matmul = prefill["matmul"]
        out.append(f"- prefill: {prefill['flops_per_token'] / 1e9:.2f} GFLOP per prompt token in the layers' "
                   f"products; the f32 GEMM rate measured here: {matmul['gflop_per_s']:.0f} GFLOP/s "
                   f"({matmul['method']}, {matmul['threads']} threads); \"prefill % of f32 GEMM\" is a "
                   "row's prefill FLOP rate over that")
    caches = sorted({f"{r['engine']} {r['info']['kv_cache']}" for r in report["results"]
                     if r.get("status") == "ok" and r.get("info", {}).get("kv_cache")})
    if caches:
        out.append(f"- KV caches: {', '.join(caches)}")
    paths = sorted({(r["amp"], r["batch"], json.dumps(r["info"]["kernel_rows"])) for r in report["results"]
                    if r.get("status") == "ok" and r.get("info", {}).get("kernel_rows")})
    if paths:
        from decoders.kernel_calibration import format_table

        table = {kind: tuple(rows) for kind, rows in json.loads(paths[0][2]).items()}
        out.append("- pyhlo's product paths, timed on this CPU: the matrix-vector kernel for "
                   f"{format_table(table)} "
                   "(activation rows; \"blocks\": GGUF block forms), XLA's dot for the others")
    if report.get("other_load"):
        shares = ", ".join(f"{b['amp']} batch {b['batch']} {b['other_cpu_fraction'] * 100:.0f}%"
                           for b in report["other_load"])
        retries = sum(b.get("retries", 0) for b in report["other_load"])
        kept = [o for r in report["results"] for o in r.get("other_cpu_fraction") or []]
        worst = f"; during the measured generations at most {max(kept) * 100:.1f}%" if kept else ""
        out.append(f"- CPU taken by other processes per configuration (waits included): {shares}{worst} "
                   f"({retries} generations repeated because of them)")
    out += [
        "",
        "## Throughput and latency",
        "",
        "median (min–max). TTFT: prefill of the prompt and the first token. decode tok/s: "
        "(new tokens − 1) / (total − TTFT), summed over the batch lines. roofline: minimum "
        "ms per step (weights / bandwidth) over the measured ms per step. vs: decode tok/s "
        "ratio to that peer. same tokens: leading greedy tokens equal to pyhlo's (worst line).",
        "",
        results_table(report["results"]),
    ]
    for amp in w.get("amps", []):
        if amp in AMP_NOTES:
            out += ["", AMP_NOTES[amp].format(model=w.get("model", "the model's file"))]
    compiled = compile_table(report["results"])
    if compiled:
        out += ["", "## to_neuron() time (from_pretrained + to_neuron)", "",
                "cold: empty compile cache; warm: a second process with the same cache.", "", compiled]
    if report.get("buckets"):
        out += ["", "## Decode latency per token bucket (pyhlo)", "",
                "ms per decode step while the sequence length falls in each bucket; "
                "vs largest bucket: how much faster than always attending over n_positions.", "",
                bucket_table(report["buckets"])]
    if report.get("notes"):
        out += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(out) + "\n"


def device_ratio_lines(rows: Sequence[dict]) -> list[str]:
    """pyhlo's decode tok/s over each peer's, per precision and batch size."""
    lines = []
    ours = [r for r in rows if r["engine"] == "pyhlo" and r.get("status") == "ok"]
    for peer in DEVICE_RATIO_PEERS:
        pairs = [f"{r['amp']} batch {r['batch']} {r['vs'][peer]:.2f}×" for r in ours if r["vs"].get(peer)]
        if pairs:
            lines.append(f"- decode tok/s, pyhlo ÷ {ENGINE_LABELS[peer]}: {', '.join(pairs)}")
    return lines


def device_line(machine: dict) -> str:
    cores = f"{machine.get('cores', '?')} logical cores"
    if machine["device"] == "cpu":
        return f"CPU {machine['device_name']}, {cores}"
    return f"{machine['device_name']} ({machine['device']}); host CPU {machine.get('cpu', '?')}, {cores}"


def device_report_markdown(report: dict) -> str:
    """The whole device report as markdown (what `pyhlo bench --device` prints)."""
    w, m, bw = report["workload"], report["machine"], report["bandwidth"]
    versions = ", ".join(f"{k} {v}" for k, v in m.get("versions", {}).items())
    out = [
        f"# pyhlo bench --device {w['device']}",
        "",
        f"Model {w['model']}; prompt {w['prompt_tokens']} random token ids, {w['new_tokens']} new tokens "
        f"(greedy, EOS ignored); n_positions {w['n_positions']}; measured rounds: {w['repeats']} after a "
        "warm-up, engines taking turns.",
        "",
        f"- device: {device_line(m)}",
        f"- versions: {versions}",
        f"- bandwidth: {bw['gb_per_s']:,.1f} GB/s ({bw['method']}, median of {len(bw['samples_gb_per_s'])} "
        f"passes over {bw['array_mb']:,.0f} MB)",
    ]
    for amp, floor in report["floor"].items():
        out.append(f"- floor {amp}: {floor['weight_bytes'] / 1e6:,.1f} MB of weights read once per decode "
                   f"step -> {floor['floor_ms']:.3f} ms per step ({1e3 / floor['floor_ms']:,.0f} steps/s)")
    out += device_ratio_lines(report["results"])
    out += [
        "",
        "median (min–max). TTFT: prefill of the prompt and the first token. decode tok/s: (new tokens − 1) / "
        "(total − TTFT), summed over the batch lines. % of floor: floor ms / measured ms per step. compile "
        "s: pyhlo's from_pretrained + to_neuron() into an empty compile cache; hf-compiled: the warm-up "
        "generation's time over a measured one's. same tokens: leading greedy tokens equal to pyhlo's (worst "
        "line).",
        "",
        device_results_table(report["results"]),
    ]
    if report.get("notes"):
        out += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(out) + "\n"


# -- files -------------------------------------------------------------------------
def write_json(report: dict, path: pathlib.Path) -> None:
    path.write_text(json.dumps(report, indent=2, default=_jsonable) + "\n")


def _jsonable(value: Any):
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def write_png(report: dict, path: pathlib.Path) -> None:
    """Decode tokens/s and TTFT by engine, precision and batch, and ms/step per bucket."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["results"] if r.get("status") == "ok"]
    amps = list(report["workload"].get("amps", []))
    configs = sorted({(r["amp"], r["batch"]) for r in rows},
                     key=lambda c: (amps.index(c[0]) if c[0] in amps else len(amps), c[0], c[1]))
    engines = [e for e in ("pyhlo", "hf", "llamacpp") if any(r["engine"] == e for r in rows)]
    engines += sorted({r["engine"] for r in rows} - set(engines))
    by_key = {(r["engine"], r["amp"], r["batch"]): r for r in rows}
    panels = 3 if report.get("buckets") else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5))
    width = 0.8 / max(1, len(engines))
    for ax, metric, title in ((axes[0], "decode_tokens_per_s", "decode tokens/s (higher is better)"),
                              (axes[1], "ttft_ms", "time to first token, ms (lower is better)")):
        for k, engine in enumerate(engines):
            xs, heights, low, high = [], [], [], []
            for i, config in enumerate(configs):
                row = by_key.get((engine, *config))
                if row is None:
                    continue
                s = row[metric]
                xs.append(i + (k - (len(engines) - 1) / 2) * width)
                heights.append(s["median"])
                low.append(s["median"] - s["min"])
                high.append(s["max"] - s["median"])
            ax.bar(xs, heights, width, yerr=[low, high], capsize=3, label=ENGINE_LABELS.get(engine, engine))
        if metric == "decode_tokens_per_s":
            for i, (amp, batch) in enumerate(configs):
                roof = report.get("roofline", {}).get(amp)
                if roof:
                    bound = batch * 1e3 / roof["min_ms_per_step"]
                    ax.hlines(bound, i - 0.45, i + 0.45, colors="black", linestyles="dashed",
                              label="roofline" if i == 0 else None)
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels([f"{amp}\nbatch {batch}" for amp, batch in configs])
        ax.set_title(title)
        ax.legend(fontsize=8)
    if panels == 3:
        ax = axes[2]
        series: dict[tuple, list] = {}
        for b in report["buckets"]:
            series.setdefault((b["amp"], b["batch"]), []).append(b)
        for (amp, batch), points in sorted(series.items()):
            ax.plot([p["bucket"] for p in points], [p["ms_per_step"]["median"] for p in points],
                    marker="o", label=f"{amp} batch {batch}")
        ax.set_xscale("log", base=2)
        sizes = sorted({b["bucket"] for b in report["buckets"]})
        ax.set_xticks(sizes)
        ax.set_xticklabels([str(b) for b in sizes])
        ax.set_ylim(bottom=0)
        ax.set_ylabel("ms per step (median)")
        ax.set_xlabel("token bucket (cache positions attended)")
        ax.set_title("pyhlo ms per decode step by bucket")
        ax.legend(fontsize=8)
    fig.suptitle(f"{report['workload']['model']}: prompt {report['workload']['prompt_tokens']}, "
                 f"{report['workload']['new_tokens']} new tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# Per schema: the files a report is written to.
FILES = {SCHEMA: {"json": "bench.json", "md": "bench.md", "png": "bench.png"},
         DEVICE_SCHEMA: {"json": "bench_device.json", "md": "bench_device.md"}}


def write_all(report: dict, directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """The report's files in `directory` (CPU: bench.json, bench.md and bench.png; device:
    bench_device.json and bench_device.md); returns their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = {kind: directory / name for kind, name in FILES[report["schema"]].items()}
    write_json(report, paths["json"])
    paths["md"].write_text(markdown(report))
    if "png" in paths:
        write_png(report, paths["png"])
    return paths


def markdown(report: dict) -> str:
    """The report as markdown, in its schema's form."""
    return device_report_markdown(report) if report["schema"] == DEVICE_SCHEMA else report_markdown(report)
