"""`pyhlo bench --suite`: its parts run one after another into one summary, a run resumes only on
the same code and CPU, and each row's goal is judged by the ratio the goals name."""
from __future__ import annotations

import json

import pytest

from tools.bench import suite
from tools.cli import main


def _row(**rates) -> dict:
    row = {"model": "m", "weights": "Q4_0", "mode": "int8", "batch": 1, "roofline": 0.5}
    for phase in ("decode", "prefill"):
        for engine in ("pyhlo", "llamacpp", "hf"):
            row[f"{phase}_{engine}"] = rates.get(f"{phase}_{engine}")
    return row


@pytest.mark.parametrize("batch, ours, goal", [(1, 10.9, False), (1, 11.0, True), (4, 10.0, True),
                                               (4, 9.9, False)])
def test_decode_goal_is_1_1x_llama_cpp_at_batch_1_and_1_0x_past_it(batch, ours, goal):
    row = {**_row(decode_pyhlo=ours, decode_llamacpp=10.0), "batch": batch}
    assert suite.decode_goal_met(row) is goal


def test_prefill_goal_needs_every_peer_that_ran():
    assert suite.prefill_goal_met(_row(prefill_pyhlo=10.0, prefill_llamacpp=9.0)) is True
    assert suite.prefill_goal_met(_row(prefill_pyhlo=10.0, prefill_llamacpp=9.0, prefill_hf=11.0)) is False
    assert suite.prefill_goal_met(_row(prefill_pyhlo=10.0)) is None


def test_engine_rows_put_each_pyhlo_mode_beside_the_peer_run_of_the_same_precision_and_batch():
    def result(engine, amp, batch, decode, ttft_ms):
        return {"engine": engine, "amp": amp, "batch": batch, "status": "ok", "roofline_fraction": 0.4,
                "decode_tokens_per_s": {"median": decode},
                "prefill_tokens_per_s": {"median": 128e3 / ttft_ms}}

    report = {"results": [result("pyhlo", "gguf", 1, 8.0, 4000),
                          result("llamacpp", "gguf", 1, 16.0, 3200),
                          result("pyhlo", "gguf-x8", 1, 18.0, 3000),
                          result("llamacpp", "gguf-x8", 1, 15.0, 3300),
                          {"engine": "hf", "amp": "gguf", "batch": 1, "status": "unavailable"}]}
    part = suite.Part("x", "SmolLM2-1.7B shape", "Q4_0", ())
    exact, int8 = suite.engine_rows(part, report)
    assert (exact["mode"], exact["decode_pyhlo"], exact["decode_llamacpp"], exact["decode_hf"]) == (
        "exact", 8.0, 16.0, None)
    assert (int8["mode"], int8["decode_llamacpp"]) == ("int8", 15.0)
    assert int8["prefill_llamacpp"] == pytest.approx(128e3 / 3300)
    table = suite.decode_table([exact, int8])
    assert "| 0.50× |" in table and "**missed**" in table and "| 1.20× |" in table


def test_serving_goal_is_tokens_and_first_token_against_both_servers():
    def row(engine, clients, rate, ttft):
        return {"engine": engine, "clients": clients, "requests": 8, "tokens": 512, "seconds": 1.0,
                "tokens_per_s": rate, "ttft_p50_ms": ttft, "ttft_p95_ms": ttft * 2}

    rows = [row("pyhlo-x8", 1, 80, 50), row("llama-server", 1, 84, 57), row("vllm", 1, 20, 125),
            row("pyhlo-x8", 8, 140, 110), row("llama-server", 8, 110, 178), row("vllm", 8, 100, 217)]
    goals = {g["clients"]: g for g in suite.serving_goals(rows)}
    assert goals[1]["met"] is False and goals[1]["vs_llama-server"] == pytest.approx(80 / 84)
    assert goals[8]["met"] is True and goals[8]["vs_vllm"] == pytest.approx(1.4)


def test_parts_are_named_and_checked():
    assert [p.name for p in suite.select_parts("serve,135m-dense")] == ["135m-dense", "serve"]
    with pytest.raises(ValueError, match="no such part"):
        suite.select_parts("135m-nope")
    assert len({p.name for p in suite.PARTS}) == len(suite.PARTS)


def test_a_suite_runs_its_parts_into_one_summary_and_resumes(monkeypatch, tmp_path, capsys):
    tiny = suite.Part("tiny-q8_0", "tiny", "Q8_0", ("--random-model", "tiny-smollm2", "--gguf-type", "q8_0",
                                                   "--amp", "gguf", "--quick", "--engines", "pyhlo"))
    monkeypatch.setattr(suite, "PARTS", (tiny,))
    out = tmp_path / "suite"
    assert main(["bench", "--suite", "--quiet-wait", "0", "--out", str(out)]) == 0
    summary = (out / "suite.md").read_text()
    assert summary.startswith("# pyhlo bench --suite")
    row = next(line for line in summary.splitlines() if line.startswith("| tiny |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:4] == ["tiny", "Q8_0", "exact", "1"]
    assert float(cells[4].split(" / ")[0].replace(",", "")) > 0   # pyhlo's decode rate; no peer: no ratio
    state = json.loads((out / "suite.json").read_text())
    assert state["parts"]["tiny-q8_0"]["status"] == "ok"
    capsys.readouterr()

    assert main(["bench", "--suite", "--quiet-wait", "0", "--out", str(out)]) == 0
    assert "tiny-q8_0: measured before, kept" in capsys.readouterr().err

    state["code"] = "another-commit"
    (out / "suite.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match="give a new --out"):
        suite.run(type("Args", (), {"suite_parts": None, "out": str(out), "threads": 1, "quiet_wait": 0})())
