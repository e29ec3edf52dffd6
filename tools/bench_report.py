"""Numbers and output of `pyhlo bench`: statistics, ratios, roofline, markdown, JSON, PNG.

Everything here is pure (no timing, no models), so it is tested on made-up numbers.
A result row is a dict with these keys (JSON schema `pyhlo-bench/1`):

    engine, amp ("f32" | "bf16" | "s8"), batch, status ("ok" | "unavailable" | "error"), error,
    ttft_ms, decode_tokens_per_s, ms_per_step     summaries: {median, min, max, n, samples}
    load_s, compile_cold_s, compile_warm_s, peak_rss_mb, cold_peak_rss_mb, rss_mb
    roofline_fraction, vs ({peer: decode ratio}), ttft_vs ({peer: TTFT ratio}),
    agreement ({reference, matching_new_tokens: [per line], new_tokens}),
    other_cpu_fraction ([per sample: share of the CPUs other processes took]), disturbed_samples, info,
    warmup_s (the warm-up generation's wall time), total_s (summary of the measured generations' wall time),
    tokens (the warm-up generation's new token ids, per line)
"""
from __future__ import annotations

import json
import math
import pathlib
import statistics
from typing import Any, Iterable, Sequence

SCHEMA = "pyhlo-bench/1"
ENGINE_LABELS = {"pyhlo": "pyhlo", "hf": "HF transformers", "hf-compiled": "HF static cache + torch.compile",
                 "llamacpp": "llama.cpp"}
PEERS = ("hf", "hf-compiled", "llamacpp")
TABLE_COLUMNS = (
    "engine", "amp", "batch", "TTFT ms", "decode tok/s", "ms/step", "roofline",
    "vs HF", "vs llama.cpp", "load s", "peak RSS MB", "same tokens",
)
BUCKET_COLUMNS = ("amp", "batch", "bucket", "steps", "ms/step", "vs largest bucket")
COMPILE_COLUMNS = ("amp", "batch", "cold to_neuron s", "warm to_neuron s", "cold peak RSS MB")
# What a precision means for each engine, where the name alone does not say it.
AMP_NOTES = {
    "s8": "s8: int8 weights for the decoder layers' linear products, embeddings, LM head and norms f32 "
          "(pyhlo: one f32 scale per row; llama.cpp: Q8_0, one f16 scale per 32 values; HF transformers: "
          "torch dynamic int8 quantization of the layers' Linear modules, activations quantized per product); "
          "vs compares engines at the same precision. The three round differently (llama.cpp and torch quantize "
          "the activations too), so their greedy tokens part from pyhlo's sooner than in f32.",
    "gguf": "gguf: the GGUF file's own weights as stored (SmolLM2-135M-Instruct.Q4_1.gguf: Q4_1 layer matrices, "
            "Q8_0 embedding / LM head, f32 norms); pyhlo runs the blocks as stored, dequantized inside its kernels, "
            "llama.cpp reads the same file (and quantizes the activations to 8 bits for its products).",
    "gguf-x8": "gguf-x8: the same file, with pyhlo's kernels rounding the activations of the block products to int8 "
               "per 32 values and multiplying integers (NeuronConfig(int8_activations=True)), as llama.cpp does; "
               "llama.cpp's row is the same as gguf's, run again.",
}


# -- statistics ------------------------------------------------------------------
def summarize(values: Iterable[float]) -> dict | None:
    """Median, min and max of the samples (None when there are none)."""
    samples = [float(v) for v in values]
    if not samples:
        return None
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
            "n": len(samples), "samples": samples}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def median_of(summary: dict | None) -> float | None:
    return None if summary is None else summary["median"]


def decode_metrics(ttft_s: float, total_s: float, new_tokens: int, batch: int) -> dict:
    """One generation's speed: decode is everything after the first token.

    ms_per_step: (total - ttft) / (new_tokens - 1); tokens_per_s adds up the batch lines.
    """
    if new_tokens < 2:
        raise ValueError(f"decode speed needs at least 2 new tokens, got {new_tokens}")
    step_s = (total_s - ttft_s) / (new_tokens - 1)
    return {"ttft_ms": ttft_s * 1e3, "ms_per_step": step_s * 1e3,
            "tokens_per_s": batch / step_s if step_s > 0 else math.inf}


def matching_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# -- roofline ----------------------------------------------------------------------
def roofline_ms(weight_bytes: float, bandwidth_bytes_per_s: float) -> float:
    """The least time a decode step can take: every weight read once from memory."""
    return weight_bytes / bandwidth_bytes_per_s * 1e3


def roofline_fraction(weight_bytes: float, bandwidth_bytes_per_s: float | None,
                      ms_per_step: float | None) -> float | None:
    """Share of the memory-bandwidth bound reached: roofline ms / measured ms per step."""
    if not bandwidth_bytes_per_s or not ms_per_step:
        return None
    return roofline_ms(weight_bytes, bandwidth_bytes_per_s) / ms_per_step


def add_roofline_fractions(rows: list[dict], weight_bytes: dict[str, float], bandwidth_bytes_per_s: float) -> None:
    """Fill each ok row's `roofline_fraction` from its amp's weight bytes (weight_bytes[amp])
    and its median ms per step."""
    for row in rows:
        if row["status"] == "ok":
            row["roofline_fraction"] = roofline_fraction(weight_bytes[row["amp"]], bandwidth_bytes_per_s,
                                                         median_of(row["ms_per_step"]))


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


def bucket_rows(step_ms: Sequence[float], prompt_length: int, buckets: Sequence[int]) -> list[dict]:
    """Group per-step decode times by the token bucket each step ran in.

    step_ms[j] is the time between new tokens j and j + 1 (from 0): that step fed token j
    to the model with prompt_length + j + 1 tokens in the cache, so it ran in the bucket
    pick(buckets, prompt_length + j + 1).
    """
    import bisect

    grouped: dict[int, list[float]] = {b: [] for b in buckets}
    for j, ms in enumerate(step_ms):
        i = bisect.bisect_left(buckets, prompt_length + j + 1)
        if i < len(buckets):
            grouped[buckets[i]].append(ms)
    rows = [{"bucket": b, "ms_per_step": summarize(v)} for b, v in grouped.items() if v]
    largest = rows[-1]["ms_per_step"]["median"] if rows else None
    for row in rows:
        row["vs_largest"] = ratio(largest, row["ms_per_step"]["median"])
    return rows


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
    return f"{_num(summary['median'], digits)} ({_num(summary['min'], digits)}–{_num(summary['max'], digits)})"


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


def results_table(rows: Sequence[dict]) -> str:
    cells = []
    for row in rows:
        label = ENGINE_LABELS.get(row["engine"], row["engine"])
        if row.get("status") != "ok":
            reason = row.get("error") or row.get("status")
            cells.append([label, row["amp"], row["batch"], f"{row.get('status')}: {reason}"]
                         + ["–"] * (len(TABLE_COLUMNS) - 4))
            continue
        cells.append([
            label, row["amp"], row["batch"], spread(row["ttft_ms"]), spread(row["decode_tokens_per_s"]),
            spread(row["ms_per_step"], 2), _percent(row.get("roofline_fraction")),
            _times(row["vs"].get("hf")), _times(row["vs"].get("llamacpp")), _num(row.get("load_s")),
            _num(row.get("peak_rss_mb"), 0), agreement_cell(row),
        ])
    return markdown_table(TABLE_COLUMNS, cells)


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
                   f"best of {len(runs)} measurements through the run: {', '.join(f'{r:.1f}' for r in runs)})")
        for amp, roof in report.get("roofline", {}).items():
            out.append(f"- roofline {amp}: {_num(roof['weight_bytes'] / 1e6, 1)} MB of weights per step -> "
                       f"at least {roof['min_ms_per_step']:.2f} ms per step "
                       f"(at most {roof['max_tokens_per_s_batch1']:.0f} tokens/s at batch 1)")
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
            out += ["", AMP_NOTES[amp]]
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


def write_all(report: dict, directory: pathlib.Path) -> dict[str, pathlib.Path]:
    """bench.json, bench.md and bench.png in `directory`; returns their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = {"json": directory / "bench.json", "md": directory / "bench.md", "png": directory / "bench.png"}
    write_json(report, paths["json"])
    paths["md"].write_text(report_markdown(report))
    write_png(report, paths["png"])
    return paths
