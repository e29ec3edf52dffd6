"""`pyhlo bench --suite`: every row the performance goals name, in one run on one machine.

The suite runs `pyhlo bench` once per part, one part after another (each in a process of its own,
its results in OUT/<part>/), then writes one summary, OUT/suite.md, that puts pyhlo beside each peer
on the same weights with the ratio and whether the goal is met:

  decode    tokens/s at batch 1 and 4: >= 1.1x llama.cpp at batch 1, >= 1.0x at batch 4
  prefill   prompt tokens/s (128 and 1,024 tokens): >= 1.0x llama.cpp and >= 1.0x HF transformers
  serving   `pyhlo serve` at 1 / 4 / 8 clients: tokens/s >= 1.0x llama-server and vLLM, TTFT p50
            no worse than either

at SmolLM2-135M (its own Q4_1 file, its weights in f32 and bf16, and random weights of its shape
as Q8_0, Q4_0 and Q4_K_M files) and at SmolLM2-1.7B's shape (random weights: f32, bf16, Q8_0, Q4_0,
Q4_K_M). GGUF files run two ways in pyhlo: "exact" (the blocks as stored, f32 activations) and
"int8" (the activations rounded to int8, as llama.cpp does), each beside a llama.cpp run of the
same file.

A run is resumable: run the same command again with the same --out and the parts already measured
are kept, provided the code (its git commit) and the CPU are the same; otherwise give a new --out.
`--suite-parts` runs some parts only. On 2 cores the whole suite took 65 minutes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import subprocess
import sys
import time
from dataclasses import dataclass

from tools.bench import serve
from tools.bench.machine import cpu_name
from tools.bench.settings import csv
from tools.bench.stats import median_of

SCHEMA = "pyhlo-bench-suite/1"


@dataclass(frozen=True)
class Part:
    """One `pyhlo bench` run of the suite: its name (its folder), what it measures, its options."""
    name: str
    model: str
    weights: str
    args: tuple[str, ...]
    table: str = "decode"        # "decode" (128-token prompts), "prefill" (1,024-token prompts) or "serve"


_COMMON = ("--no-compile-times", "--no-buckets")
_SMALL = ("--batch", "1,4", "--repeats", "2", "--new-tokens", "64")
_LARGE = ("--random-model", "smollm2-1.7b", "--batch", "1,4", "--repeats", "1", "--new-tokens", "32",
          "--kv-cache-dtype", "bf16")
_LONG_SMALL = ("--batch", "1", "--prompt-tokens", "1024", "--new-tokens", "8", "--n-positions", "1088",
               "--repeats", "2")
_LONG_LARGE = ("--random-model", "smollm2-1.7b", "--batch", "1", "--prompt-tokens", "1024", "--new-tokens",
               "4", "--n-positions", "1088", "--repeats", "1", "--kv-cache-dtype", "bf16")
_BLOCKS = ("--amp", "gguf,gguf-x8", "--engines", "pyhlo,llamacpp")
SMALL, LARGE = "SmolLM2-135M", "SmolLM2-1.7B shape"

PARTS: tuple[Part, ...] = (
    Part("135m-dense", SMALL, "f32 / bf16", ("--amp", "f32,bf16", "--engines", "pyhlo,hf,llamacpp", *_SMALL)),
    Part("135m-q4_1", SMALL, "Q4_1 (its file)", (*_BLOCKS, *_SMALL)),
    *(Part(f"135m-{kind}", f"{SMALL} shape", kind.upper(),
           ("--random-model", "smollm2-135m", "--gguf-type", kind, *_BLOCKS, *_SMALL))
      for kind in ("q8_0", "q4_0", "q4_k_m")),
    # The dense 1.7 B rows read the random weights' BF16 GGUF file (llama.cpp reads GGUF files only;
    # pyhlo widens it to f32 for the f32 row, and llama.cpp gets an F32 file written from it). HF's
    # f32 copy beside pyhlo's and llama.cpp's (6.8 GB each) would not fit 24 GiB: HF runs bf16.
    Part("1.7b-bf16", LARGE, "bf16",
         ("--gguf-type", "bf16", "--amp", "bf16", "--engines", "pyhlo,hf,llamacpp", *_LARGE)),
    Part("1.7b-f32", LARGE, "f32", ("--gguf-type", "bf16", "--amp", "f32", "--engines", "pyhlo,llamacpp",
                                    *_LARGE)),
    *(Part(f"1.7b-{kind}", LARGE, kind.upper(), ("--gguf-type", kind, *_BLOCKS, *_LARGE))
      for kind in ("q8_0", "q4_0", "q4_k_m")),
    Part("135m-prefill-1024", SMALL, "f32 / bf16 / Q4_1 (its file)",
         ("--amp", "f32,bf16,gguf-x8", "--engines", "pyhlo,hf,llamacpp", *_LONG_SMALL), table="prefill"),
    # HF's bf16 prompt runs at about 5 tokens/s at 1.7 B on a CPU without bf16 dot instructions
    # (7 minutes a 1,024-token row): its long-prompt rows are the 135 M ones.
    Part("1.7b-prefill-1024-bf16", LARGE, "bf16",
         ("--gguf-type", "bf16", "--amp", "bf16", "--engines", "pyhlo,llamacpp", *_LONG_LARGE),
         table="prefill"),
    Part("1.7b-prefill-1024-q4_0", LARGE, "Q4_0", ("--gguf-type", "q4_0", *_BLOCKS, *_LONG_LARGE),
         table="prefill"),
    Part("serve", SMALL, "Q4_1 (its file; vLLM: dequantized to f32)",
         ("--serve", "--engines", "pyhlo,pyhlo-x8,llama-server,vllm"), table="serve"),
)
MODES = {"f32": "f32", "bf16": "bf16", "s8": "s8", "gguf": "exact", "gguf-x8": "int8"}
DECODE_GOAL = {1: 1.1}           # batch -> least ratio to llama.cpp; other batches 1.0
PREFILL_GOAL = 1.0


def run(args: argparse.Namespace) -> int:
    """Run the suite's parts not yet measured in --out, then write suite.md and suite.json."""
    parts = select_parts(args.suite_parts)
    out = pathlib.Path(args.out)
    state = open_run(out)
    passthrough = ["--threads", str(args.threads), "--quiet-wait", str(args.quiet_wait)]
    for index, part in enumerate(parts, 1):
        done = state["parts"].get(part.name, {})
        if done.get("status") == "ok":
            print(f"[suite] {index}/{len(parts)} {part.name}: measured before, kept", file=sys.stderr)
            continue
        print(f"[suite] {index}/{len(parts)} {part.name} ...", file=sys.stderr)
        state["parts"][part.name] = run_part(part, out, passthrough)
        (out / "suite.json").write_text(json.dumps(state, indent=1))
        print(f"[suite] {part.name}: {state['parts'][part.name]['status']} in "
              f"{state['parts'][part.name]['seconds']:.0f} s", file=sys.stderr)
    text = summary(out, state)
    (out / "suite.md").write_text(text)
    print(text)
    print(f"wrote {out / 'suite.md'}, {out / 'suite.json'}", file=sys.stderr)
    return 0 if all(p.get("status") == "ok" for p in state["parts"].values()) else 1


def select_parts(names: str | None) -> list[Part]:
    """The parts --suite-parts names (all by default), in the suite's order."""
    if not names:
        return list(PARTS)
    known = [p.name for p in PARTS]
    wanted = csv(names)
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise ValueError(f"--suite-parts {','.join(unknown)}: no such part; the parts are {', '.join(known)}")
    return [p for p in PARTS if p.name in wanted]


def code_version() -> str:
    """The git commit of the code that runs (with "+changes" when the tree differs from it), or the
    package's version outside a git checkout."""
    root = pathlib.Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                                text=True, check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                 capture_output=True, text=True, check=True).stdout.strip()
        return commit + ("+changes" if changed else "")
    except (OSError, subprocess.CalledProcessError):
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"pyhlo {version('pyhlo')}"
        except PackageNotFoundError:
            return "unknown"


def open_run(out: pathlib.Path) -> dict:
    """The run's state in out/suite.json: a new one, or the one there if it is of the same code on the
    same CPU (a resumed run); a run of other code or another CPU is an error, never mixed in."""
    code, cpu = code_version(), cpu_name()
    path = out / "suite.json"
    if path.is_file():
        state = json.loads(path.read_text())
        if state.get("schema") != SCHEMA or state.get("code") != code or state.get("cpu") != cpu:
            raise ValueError(f"{path} holds a run of {state.get('code')} on {state.get('cpu')}, and this is "
                             f"{code} on {cpu}: one summary never mixes them; give a new --out")
        return state
    out.mkdir(parents=True, exist_ok=True)
    state = {"schema": SCHEMA, "code": code, "cpu": cpu,
             "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "parts": {}}
    path.write_text(json.dumps(state, indent=1))
    return state


def run_part(part: Part, out: pathlib.Path, passthrough: list[str]) -> dict:
    """Run one part's `pyhlo bench` into out/<part>/, its output in out/<part>.log."""
    folder = out / part.name
    common = () if part.table == "serve" else _COMMON
    command = [sys.executable, "-m", "tools", "bench", *part.args, *common, *passthrough,
               "--out", str(folder)]
    start = time.monotonic()
    with open(out / f"{part.name}.log", "w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
    result = folder / ("serve.json" if part.table == "serve" else "bench.json")
    status = "ok" if code == 0 and result.is_file() else "failed"
    return {"status": status, "returncode": code, "seconds": time.monotonic() - start,
            "command": " ".join(["pyhlo", *command[3:]]),
            "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


# -- the summary -----------------------------------------------------------------------------------
def summary(out: pathlib.Path, state: dict) -> str:
    """suite.md: the machine, then one table per kind of part, then what failed."""
    parts = [p for p in PARTS if state["parts"].get(p.name, {}).get("status") == "ok"]
    lines = [f"# pyhlo bench --suite\n\nCode {state['code']}; CPU {state['cpu']}; started "
             f"{state['started']}. Ratios are pyhlo's rate over the peer's (above 1: pyhlo is faster); the "
             "goal column says whether the row meets its goal.\n"]
    machine = _first_machine(out, parts)
    if machine:
        lines.append(machine + "\n")
    for table, title in (("decode", "Decode and prefill, 128-token prompts"),
                         ("prefill", "Prefill, 1,024-token prompts"), ("serve", "Serving")):
        chosen = [p for p in parts if p.table == table]
        if not chosen:
            continue
        lines.append(f"## {title}\n")
        if table == "serve":
            lines.append(serving_table(json.loads((out / chosen[0].name / "serve.json").read_text())) + "\n")
        else:
            rows = [row for p in chosen for row in engine_rows(p, json.loads((out / p.name / "bench.json")
                                                                             .read_text()))]
            lines.append((decode_table(rows) if table == "decode" else prefill_table(rows)) + "\n")
    failed = {n: s for n, s in state["parts"].items() if s.get("status") != "ok"}
    for name, status in failed.items():
        lines.append(f"- part {name} failed (exit {status.get('returncode')}): see {name}.log\n")
    return "\n".join(lines)


def _first_machine(out: pathlib.Path, parts: list[Part]) -> str:
    for part in parts:
        if part.table != "serve":
            report = json.loads((out / part.name / "bench.json").read_text())
            m, bandwidth = report["machine"], report["bandwidth"]
            probes = ", ".join(f"{b:.1f}" for b in bandwidth.get("all_probes_gb_per_s",
                                                                 [bandwidth["gb_per_s"]]))
            return (f"{m['cores']} cores, {m['memory_gib']:.1f} GiB, flags {' '.join(m['cpu_flags'])}; "
                    f"{', '.join(f'{k} {v}' for k, v in m['versions'].items())}; memory read bandwidth "
                    f"probed in the first part at {probes} GB/s (each part probes its own)")
    return ""


def engine_rows(part: Part, report: dict) -> list[dict]:
    """One row per pyhlo result of a part's report, with the peers' rates beside it."""
    results = [r for r in report["results"] if r.get("status") == "ok"]
    by_key = {(r["engine"], r["amp"], r["batch"]): r for r in results}
    rows = []
    for ours in (r for r in results if r["engine"] == "pyhlo"):
        peers = {e: by_key.get((e, ours["amp"], ours["batch"])) for e in ("llamacpp", "hf")}
        beside = {"pyhlo": ours, **peers}
        rows.append({"model": part.model, "weights": _weights(part, ours["amp"]), "mode": MODES[ours["amp"]],
                     "batch": ours["batch"], "roofline": ours.get("roofline_fraction"),
                     **{f"decode_{e}": _rate(r, "decode_tokens_per_s") for e, r in beside.items()},
                     **{f"prefill_{e}": _rate(r, "prefill_tokens_per_s") for e, r in beside.items()}})
    return rows


def _weights(part: Part, amp: str) -> str:
    if amp in ("f32", "bf16") and "/" in part.weights:
        return amp
    if amp == "gguf-x8" and "/" in part.weights:
        return part.weights.split(" / ")[-1]
    return part.weights


def _rate(row: dict | None, key: str) -> float | None:
    return None if row is None else median_of(row.get(key))


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours and theirs else None


def decode_goal_met(row: dict) -> bool | None:
    """Decode: >= 1.1x llama.cpp at batch 1, >= 1.0x past it; None without a llama.cpp row."""
    r = ratio(row["decode_pyhlo"], row["decode_llamacpp"])
    return None if r is None else r >= DECODE_GOAL.get(row["batch"], 1.0)


def prefill_goal_met(row: dict) -> bool | None:
    """Prefill: >= 1.0x every peer that ran (llama.cpp, HF); None without one."""
    ratios = [ratio(row["prefill_pyhlo"], row[f"prefill_{e}"]) for e in ("llamacpp", "hf")]
    ratios = [r for r in ratios if r is not None]
    return None if not ratios else min(ratios) >= PREFILL_GOAL


def _num(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def _times(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def _share(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


def _goal(met: bool | None) -> str:
    return "–" if met is None else ("met" if met else "**missed**")


def _phase(r: dict, phase: str) -> str:
    """A row's cells for "decode" or "prefill": the three rates, then pyhlo's ratio to each peer."""
    return (f"{_num(r[f'{phase}_pyhlo'])} / {_num(r[f'{phase}_llamacpp'])} / {_num(r[f'{phase}_hf'])} | "
            f"{_times(ratio(r[f'{phase}_pyhlo'], r[f'{phase}_llamacpp']))} | "
            f"{_times(ratio(r[f'{phase}_pyhlo'], r[f'{phase}_hf']))}")


def _table(head: str, rows: list[dict], cells) -> str:
    lines = [head, "|" + "---|" * (head.count(" | ") + 1)]
    lines += [f"| {r['model']} | {r['weights']} | {r['mode']} | {r['batch']} | {cells(r)} |" for r in rows]
    return "\n".join(lines)


def decode_table(rows: list[dict]) -> str:
    head = ("| model | weights | pyhlo | batch | decode tok/s pyhlo / llama.cpp / HF | vs llama.cpp | "
            "vs HF | roofline | goal | prefill tok/s pyhlo / llama.cpp / HF | vs llama.cpp | vs HF | goal |")
    return _table(head, rows, lambda r: f"{_phase(r, 'decode')} | {_share(r['roofline'])} | "
                                        f"{_goal(decode_goal_met(r))} | {_phase(r, 'prefill')} | "
                                        f"{_goal(prefill_goal_met(r))}")


def prefill_table(rows: list[dict]) -> str:
    head = ("| model | weights | pyhlo | batch | prefill tok/s pyhlo / llama.cpp / HF | vs llama.cpp | "
            "vs HF | goal |")
    return _table(head, rows, lambda r: f"{_phase(r, 'prefill')} | {_goal(prefill_goal_met(r))}")


def serving_goals(rows: list[dict]) -> list[dict]:
    """Per pyhlo server and client count: tokens/s over llama-server's and vLLM's, and whether the
    goal (>= 1.0x both, TTFT p50 no later than either) is met."""
    peers = {(r["engine"], r["clients"]): r for r in rows if r["engine"] not in serve.PYHLO_SERVERS}
    goals = []
    for ours in (r for r in rows if r["engine"] in serve.PYHLO_SERVERS):
        beside = [peers[(e, ours["clients"])] for e in ("llama-server", "vllm")
                  if (e, ours["clients"]) in peers]
        met = None if not beside else all(ours["tokens_per_s"] >= p["tokens_per_s"]
                                          and ours["ttft_p50_ms"] <= p["ttft_p50_ms"] for p in beside)
        goals.append({"engine": ours["engine"], "clients": ours["clients"], "met": met,
                      **{f"vs_{p['engine']}": ours["tokens_per_s"] / p["tokens_per_s"] for p in beside}})
    return goals


def serving_table(rows: list[dict]) -> str:
    lines = [serve.table(rows), "", "| pyhlo server | clients | vs llama-server | vs vLLM | goal |",
             "|---|---|---|---|---|"]
    for g in serving_goals(rows):
        lines.append(f"| {g['engine']} | {g['clients']} | {_times(g.get('vs_llama-server'))} | "
                     f"{_times(g.get('vs_vllm'))} | {_goal(g['met'])} |")
    return "\n".join(lines)
