"""Output of `pyhlo bench --device`: the markdown report and its JSON (schema `pyhlo-bench-device/1`).

Pure formatting over the report dict tools/bench_device.py builds; rows are tools.bench rows
(see tools/bench_report.py) with `compile_s` added and `roofline_fraction` measured against
the device's floor.
"""
from __future__ import annotations

import pathlib
from typing import Sequence

from tools.bench_report import ENGINE_LABELS, agreement_cell, markdown_table, spread, write_json

SCHEMA = "pyhlo-bench-device/1"
TABLE_COLUMNS = ("engine", "amp", "batch", "TTFT ms", "decode tok/s", "ms/step", "% of floor", "compile s",
                 "same tokens")
# The peers pyhlo's decode speed is given against, in the report's order.
RATIO_PEERS = ("hf-compiled", "hf")


def _cell(value: float | None, form: str) -> str:
    return "–" if value is None else form.format(value)


def results_table(rows: Sequence[dict]) -> str:
    cells = []
    for row in rows:
        label = ENGINE_LABELS.get(row["engine"], row["engine"])
        if row.get("status") != "ok":
            cells.append([label, row["amp"], row["batch"], f"{row.get('status')}: {row.get('error')}"]
                         + ["–"] * (len(TABLE_COLUMNS) - 4))
            continue
        fraction = row.get("roofline_fraction")
        cells.append([label, row["amp"], row["batch"], spread(row["ttft_ms"]), spread(row["decode_tokens_per_s"]),
                      spread(row["ms_per_step"], 2), _cell(None if fraction is None else fraction * 100, "{:.0f}%"),
                      _cell(row.get("compile_s"), "{:.1f}"), agreement_cell(row)])
    return markdown_table(TABLE_COLUMNS, cells)


def ratio_lines(rows: Sequence[dict]) -> list[str]:
    """pyhlo's decode tok/s over each peer's, per precision and batch size."""
    lines = []
    ours = [r for r in rows if r["engine"] == "pyhlo" and r.get("status") == "ok"]
    for peer in RATIO_PEERS:
        pairs = [f"{r['amp']} batch {r['batch']} {r['vs'][peer]:.2f}×" for r in ours if r["vs"].get(peer)]
        if pairs:
            lines.append(f"- decode tok/s, pyhlo ÷ {ENGINE_LABELS[peer]}: {', '.join(pairs)}")
    return lines


def device_line(machine: dict) -> str:
    cores = f"{machine.get('cores', '?')} logical cores"
    if machine["device"] == "cpu":
        return f"CPU {machine['device_name']}, {cores}"
    return f"{machine['device_name']} ({machine['device']}); host CPU {machine.get('cpu', '?')}, {cores}"


def report_markdown(report: dict) -> str:
    w, m, bw = report["workload"], report["machine"], report["bandwidth"]
    versions = ", ".join(f"{k} {v}" for k, v in m.get("versions", {}).items())
    out = [
        f"# pyhlo bench --device {w['device']}",
        "",
        f"Model {w['model']}; prompt {w['prompt_tokens']} random token ids, {w['new_tokens']} new tokens (greedy, "
        f"EOS ignored); n_positions {w['n_positions']}; measured rounds: {w['repeats']} after a warm-up, engines "
        "taking turns.",
        "",
        f"- device: {device_line(m)}",
        f"- versions: {versions}",
        f"- bandwidth: {bw['gb_per_s']:,.1f} GB/s ({bw['method']}, median of {len(bw['samples_gb_per_s'])} passes "
        f"over {bw['array_mb']:,.0f} MB)",
    ]
    for amp, floor in report["floor"].items():
        out.append(f"- floor {amp}: {floor['weight_bytes'] / 1e6:,.1f} MB of weights read once per decode step -> "
                   f"{floor['floor_ms']:.3f} ms per step ({1e3 / floor['floor_ms']:,.0f} steps/s)")
    out += ratio_lines(report["results"])
    out += [
        "",
        "median (min–max). TTFT: prefill of the prompt and the first token. decode tok/s: (new tokens − 1) / "
        "(total − TTFT), summed over the batch lines. % of floor: floor ms / measured ms per step. compile s: "
        "pyhlo's from_pretrained + to_neuron() into an empty compile cache; hf-compiled: the warm-up generation's "
        "time over a measured one's. same tokens: leading greedy tokens equal to pyhlo's (worst line).",
        "",
        results_table(report["results"]),
    ]
    if report.get("notes"):
        out += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(out) + "\n"


def write_all(report: dict, out: pathlib.Path) -> dict[str, pathlib.Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench_device.json", "md": out / "bench_device.md"}
    write_json(report, paths["json"])
    paths["md"].write_text(report_markdown(report))
    return paths
