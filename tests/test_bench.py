"""`pyhlo bench`: a smoke run on a tiny model, and the statistics behind the tables.

Nothing here asserts a speed: timings on a shared test machine mean nothing.
"""
import json

import numpy as np
import pytest

from tools.bench import command, cpu, device, machine, peers, rounds, stats, worker
from tools.bench import report as bench_report
from tools.bench import settings as bench_settings
from tools.cli import main


# -- statistics, ratios, roofline ------------------------------------------------------
def test_summarize_gives_median_and_range():
    s = stats.summarize([3.0, 1.0, 2.0, 10.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.5, 1.0, 10.0, 4)
    assert stats.summarize([]) is None


def test_ratio_is_none_when_a_side_is_missing():
    assert stats.ratio(6.0, 3.0) == 2.0
    assert stats.ratio(None, 3.0) is None
    assert stats.ratio(1.0, 0.0) is None


def test_decode_metrics_leave_out_the_first_token():
    # 11 tokens in 1.1 s, the first after 0.1 s: 10 decode steps of 0.1 s each.
    m = stats.decode_metrics(ttft_s=0.1, total_s=1.1, new_tokens=11, batch=4)
    assert m["ttft_ms"] == pytest.approx(100.0)
    assert m["ms_per_step"] == pytest.approx(100.0)
    assert m["tokens_per_s"] == pytest.approx(40.0)  # 4 lines x 10 tokens/s
    with pytest.raises(ValueError):
        stats.decode_metrics(0.1, 0.2, new_tokens=1, batch=1)


def test_roofline_is_weights_over_bandwidth():
    assert stats.roofline_ms(500e6, 50e9) == pytest.approx(10.0)
    assert stats.roofline_fraction(500e6, 50e9, ms_per_step=20.0) == pytest.approx(0.5)
    assert stats.roofline_fraction(500e6, None, ms_per_step=20.0) is None


def test_matching_prefix():
    assert stats.matching_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert stats.matching_prefix([1, 2], [1, 2, 3]) == 2


def test_steps_are_grouped_by_the_bucket_they_ran_in():
    # Prompt of 2 tokens, buckets 4 and 8: steps attend over 3, 4 (bucket 4) then 5..8 (bucket 8).
    rows = stats.bucket_rows([1.0, 1.0, 2.0, 2.0, 2.0, 4.0], prompt_length=2, buckets=[4, 8])
    assert [(r["bucket"], r["ms_per_step"]["n"]) for r in rows] == [(4, 2), (8, 4)]
    assert rows[0]["ms_per_step"]["median"] == 1.0
    assert rows[0]["vs_largest"] == pytest.approx(2.0)
    assert rows[1]["vs_largest"] == pytest.approx(1.0)


def _row(engine, amp, batch, tokens_per_s, ttft_ms):
    row = rounds.new_row(engine, amp, batch)
    row["decode_tokens_per_s"] = stats.summarize([tokens_per_s])
    row["ttft_ms"] = stats.summarize([ttft_ms])
    row["ms_per_step"] = stats.summarize([1e3 * batch / tokens_per_s])
    return row


def test_comparisons_pair_rows_of_the_same_precision_and_batch():
    rows = [_row("pyhlo", "f32", 1, 60.0, 50.0), _row("hf", "f32", 1, 30.0, 100.0),
            _row("llamacpp", "f32", 1, 120.0, 25.0), _row("hf", "bf16", 1, 1.0, 1.0)]
    bench_report.add_comparisons(rows)
    assert rows[0]["vs"] == {"hf": 2.0, "llamacpp": 0.5}
    assert rows[0]["ttft_vs"] == {"hf": 0.5, "llamacpp": 2.0}
    assert rows[1]["vs"] == {"llamacpp": 0.25}
    assert rows[3]["vs"] == {}


def test_results_table_has_one_line_per_row_and_every_column():
    rows = [_row("pyhlo", "f32", 1, 60.0, 50.0), _row("hf", "f32", 1, 30.0, 100.0),
            {**rounds.new_row("llamacpp", "f32", 1), "status": "unavailable", "error": "not installed"}]
    bench_report.add_comparisons(rows)
    lines = bench_report.results_table(rows).splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")] == list(bench_report.TABLE_COLUMNS)
    assert len(lines) == 2 + len(rows)
    assert "2.00×" in lines[2]
    assert "unavailable: not installed" in lines[4]
    assert all(line.count("|") == len(bench_report.TABLE_COLUMNS) + 1 for line in lines)


def test_spread_shows_the_range_only_for_several_samples():
    assert bench_report.spread(stats.summarize([2.0])) == "2.0"
    assert bench_report.spread(stats.summarize([1.0, 2.0, 4.0])) == "2.0 (1.0–4.0)"


def test_bf16_slower_than_f32_is_noted():
    rows = [_row("pyhlo", "f32", 1, 60.0, 50.0), _row("pyhlo", "bf16", 1, 20.0, 50.0)]
    notes = bench_report.notes_for(rows, {"new_tokens": 128})
    assert any("3.00x slower in bf16" in n for n in notes)


def test_s8_rows_are_compared_at_their_own_precision():
    # pyhlo s8 against llama.cpp's Q8_0 row, never against an f32 row.
    rows = [_row("pyhlo", "s8", 1, 90.0, 40.0), _row("llamacpp", "s8", 1, 60.0, 20.0),
            _row("llamacpp", "f32", 1, 45.0, 20.0)]
    bench_report.add_comparisons(rows)
    assert rows[0]["vs"] == {"llamacpp": 1.5}
    assert rows[1]["vs"] == {}
    table = bench_report.results_table(rows)
    assert "| pyhlo | s8 | 1 |" in table and "1.50×" in table


def test_s8_slower_than_f32_is_noted():
    rows = [_row("hf", "f32", 1, 30.0, 50.0), _row("hf", "s8", 1, 10.0, 50.0)]
    notes = bench_report.notes_for(rows, {"new_tokens": 128})
    assert any("3.00x slower in s8" in n for n in notes)


def test_report_says_what_s8_means_when_it_ran():
    report = {"workload": {"model": "m", "prompt_tokens": 4, "new_tokens": 2, "n_positions": 8, "repeats": 1,
                           "threads": 1, "amps": ["s8"]},
              "machine": {}, "results": [_row("pyhlo", "s8", 1, 90.0, 40.0)]}
    assert bench_report.AMP_NOTES["s8"] in bench_report.report_markdown(report)
    report["workload"]["amps"] = ["f32"]
    assert bench_report.AMP_NOTES["s8"] not in bench_report.report_markdown(report)


def test_the_gguf_note_names_the_file_that_ran():
    report = {"workload": {"model": "smollm2-1.7b-0123.q4_k_m.gguf", "prompt_tokens": 4, "new_tokens": 2,
                           "n_positions": 8, "repeats": 1, "threads": 1, "amps": ["gguf"]},
              "machine": {}, "results": [_row("pyhlo", "gguf", 1, 90.0, 40.0)]}
    text = bench_report.report_markdown(report)
    assert "weights as stored (smollm2-1.7b-0123.q4_k_m.gguf, in the types it was written in)" in text
    assert "SmolLM2-135M" not in text


def test_disagreeing_tokens_are_noted():
    rows = []
    for batch, same in ((1, 128), (4, 7)):
        row = _row("llamacpp", "f32", batch, 40.0, 10.0)
        row["agreement"] = {"reference": "pyhlo", "new_tokens": 128, "matching_new_tokens": [same] * batch}
        rows.append(row)
    notes = bench_report.notes_for(rows, {"new_tokens": 128})
    assert len(notes) == 1 and "batch 4" in notes[0] and "batch 1 agrees for 128" in notes[0]
    rows[0]["agreement"]["matching_new_tokens"] = [3]
    notes = bench_report.notes_for(rows, {"new_tokens": 128})
    assert len(notes) == 2 and all("are the weights the same" in n for n in notes)


def test_a_llama_cpp_crash_on_an_amx_cpu_says_how_to_build_it_without_amx(monkeypatch):
    row = {**rounds.new_row("llamacpp", "gguf", 1), "status": "error",
           "error": "llamacpp worker exited with code -11: see logs"}
    monkeypatch.setattr(bench_report, "machine_info", lambda: {"cpu_flags": ["amx_int8", "avx512f"]})
    notes = bench_report.notes_for([row], {"new_tokens": 128})
    assert sum("-DGGML_AMX_INT8=OFF" in note for note in notes) == 1
    assert any("code -11" in note for note in notes)                    # the error itself, as ever
    monkeypatch.setattr(bench_report, "machine_info", lambda: {"cpu_flags": ["avx2"]})
    assert not any("AMX" in note for note in bench_report.notes_for([row], {"new_tokens": 128}))


# -- the pieces that touch models -------------------------------------------------------
def test_permute_rope_rows_undoes_the_loaders_unpermute():
    from decoders.checkpoints.gguf import unpermute_rope_rows

    weight = np.arange(6 * 8 * 3, dtype=np.float32).reshape(6 * 8, 3)
    assert np.array_equal(peers.permute_rope_rows(unpermute_rope_rows(weight, 6), 6), weight)


def test_weight_bytes_count_int8_layers_and_f32_scales(tiny_llama):
    # Tiny Llama: hidden 64, MLP 160, vocabulary 320, 2 layers, separate LM head.
    _, path = tiny_llama("mha", "safetensors")
    linears = 3 * 64 * 64 + 64 * 64 + 2 * 160 * 64 + 64 * 160  # q|k|v, o, gate|up, down
    rows = 3 * 64 + 64 + 2 * 160 + 64  # one scale per output row
    norms, head = 2 * 64, 320 * 64  # per layer; the LM head (the embedding table is read by row)
    f32 = 2 * 4 * (linears + norms) + 4 * (64 + head)
    s8 = 2 * (linears + 4 * rows + 4 * norms) + 4 * (64 + head)
    assert cpu.weight_bytes(path, "f32", 256) == f32
    assert cpu.weight_bytes(path, "bf16", 256) == f32 // 2
    assert cpu.weight_bytes(path, "s8", 256) == s8


def write_source_gguf(model, path):
    """A tiny HF Llama as llama.cpp's converter lays it out (F32, q and k rows in llama.cpp's
    order), with a toy vocabulary so that llama.cpp can load it."""
    from test_families_mistral_qwen2_mixtral import write_gguf

    state = {name: tensor.float().numpy() for name, tensor in model.state_dict().items()}
    return write_gguf(path, model, state, "llama", vocabulary=True)


@pytest.fixture(scope="module")
def tiny_q8_0(tiny_llama, tmp_path_factory):
    """(source GGUF, its Q8_0 copy for llama.cpp)."""
    model, _ = tiny_llama("mha", "safetensors")
    directory = tmp_path_factory.mktemp("q8_0")
    source = write_source_gguf(model, directory / "tiny.gguf")
    return source, peers.peer_gguf(source, "s8", directory / "cache")


def test_q8_0_gguf_quantizes_the_layer_matrices_only(tiny_q8_0):
    import gguf

    source, target = tiny_q8_0
    assert target.name.endswith(".q8_0.gguf")
    assert peers.peer_gguf(source, "s8", target.parent) == target  # cached
    reader = gguf.GGUFReader(target)
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    layer_matrices = {n for n in kinds if n.startswith("blk.") and not n.endswith("norm.weight")}
    assert len(layer_matrices) == 2 * 7 and all(kinds[n] == "Q8_0" for n in layer_matrices)
    # As pyhlo keeps them: embedding and LM head f32; norms f32 as llama.cpp's converter keeps them.
    assert all(kinds[n] == "F32" for n in set(kinds) - layer_matrices)
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q8_0


def test_q8_0_gguf_holds_the_source_weights(tiny_q8_0):
    from decoders.checkpoints import open_checkpoint

    source, target = tiny_q8_0
    with open_checkpoint(source) as dense, open_checkpoint(target) as quantized:
        assert sorted(quantized.names()) == sorted(dense.names())
        for name in dense.names():
            want, got = dense.get(name), quantized.get(name)
            if ".layers." not in name or want.ndim == 1:
                assert np.array_equal(got, want), name
                continue
            # Q8_0: blocks of 32 along a row, each value within half a step (amax / 127), plus
            # what rounding the step to f16 costs at the ends of the range (127 * 2**-11 steps).
            blocks = want.reshape(-1, 32)
            step = np.abs(blocks).max(axis=1, keepdims=True) / 127
            assert np.all(np.abs(got.reshape(-1, 32) - blocks) <= (0.5 + 127 * 2**-11) * step + 1e-7), name


def test_llama_cpp_runs_the_q8_0_gguf(tiny_q8_0):
    if peers.llamacpp_available():
        pytest.skip(peers.llamacpp_available())
    _, target = tiny_q8_0
    runner = peers.LlamaCppRunner(str(target), "s8", batch=2, threads=2, n_positions=64, prompt_tokens=5)
    try:
        record = runner.generate([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]], new_tokens=4)
    finally:
        runner.close()
    assert [len(line) for line in record["tokens"]] == [4, 4]


def test_hf_s8_quantizes_the_layers_not_the_lm_head(tiny_llama):
    import torch

    _, path = tiny_llama("mha", "safetensors")
    runner = peers.HFRunner(str(path), "s8", batch=1, threads=1)
    assert "14 Linear modules" in runner.info["quantized"]  # q, k, v, o, gate, up, down in 2 layers
    assert type(runner.model.lm_head) is torch.nn.Linear
    assert len(runner.generate([[5, 6, 7]], new_tokens=3)["tokens"][0]) == 3


def test_a_workers_peak_rss_is_its_own():
    # Linux hands a parent's ru_maxrss to its children across fork and exec; VmHWM is per process.
    import subprocess
    import sys

    ballast = np.ones(300 * 2**20 // 8)  # a 300 MB peak in this process
    child = subprocess.run([sys.executable, "-c",
                            "from tools.bench.worker import peak_rss_bytes; print(peak_rss_bytes())"],
                           capture_output=True, text=True, check=True, cwd=worker.ROOT)
    assert 0 < int(child.stdout) < ballast.nbytes // 2


def test_bandwidth_probe_reports_a_positive_rate():
    measured = machine.measure_bandwidth(array_mb=8, threads=2, repeats=2)
    assert measured["gb_per_s"] > 0 and len(measured["samples_gb_per_s"]) == 2


def test_options_are_checked():
    parser = bench_parser()
    with pytest.raises(ValueError, match="--amp 'f64' is not one of f32, bf16, s8"):
        bench_settings.resolve_settings(parser.parse_args(["--amp", "f64"]))
    with pytest.raises(ValueError, match="--amp 's4'"):
        bench_settings.resolve_settings(parser.parse_args(["--amp", "s8,s4"]))
    assert bench_settings.resolve_settings(parser.parse_args(["--amp", "s8, f32"]))["amps"] == ["s8", "f32"]
    with pytest.raises(ValueError, match="n-positions"):
        bench_settings.resolve_settings(parser.parse_args(["--prompt-tokens", "200", "--n-positions", "256"]))
    quick = bench_settings.resolve_settings(parser.parse_args(["--quick", "--repeats", "2"]))
    assert quick["repeats"] == 2 and quick["new_tokens"] == bench_settings.QUICK["new_tokens"]
    assert quick["kv_cache_dtype"] is None


def test_pyhlo_takes_the_kv_cache_type_the_bench_is_given():
    from tools.bench.pyhlo_runner import pyhlo_options

    settings = bench_settings.resolve_settings(bench_parser().parse_args(["--kv-cache-dtype", "bf16"]))
    assert settings["kv_cache_dtype"] == "bf16"
    for amp in bench_settings.AMPS:
        assert pyhlo_options(amp, settings["kv_cache_dtype"])["neuron_config"].kv_cache_dtype == "bf16"
        assert pyhlo_options(amp)["neuron_config"].kv_cache_dtype is None


def bench_parser():
    import argparse

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return parser


# -- a whole run ---------------------------------------------------------------------------
def test_quick_run_writes_table_json_and_chart(tiny_llama, tmp_path, capsys):
    _, path = tiny_llama("mha", "safetensors")
    out = tmp_path / "results"
    code = main(["bench", "--model", str(path), "--quick", "--engines", "pyhlo,hf", "--repeats", "1",
                 "--quiet-wait", "0", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.startswith("| engine"))
    assert [c.strip() for c in header.strip("|").split("|")] == list(bench_report.TABLE_COLUMNS)

    report = json.loads((out / "bench.json").read_text())
    assert report["schema"] == bench_report.SCHEMA
    assert {"machine", "workload", "bandwidth", "roofline", "results", "buckets", "notes"} <= set(report)
    assert report["bandwidth"]["gb_per_s"] > 0
    assert [(r["engine"], r["amp"], r["batch"]) for r in report["results"]] == [("pyhlo", "f32", 1),
                                                                                 ("hf", "f32", 1)]
    for row in report["results"]:
        assert row["status"] == "ok", row["error"]
        for key in ("ttft_ms", "decode_tokens_per_s", "ms_per_step"):
            assert set(row[key]) == {"median", "min", "max", "n", "samples"} and row[key]["n"] == 1
        assert row["peak_rss_mb"] > 0 and row["load_s"] > 0
        assert len(row["other_cpu_fraction"]) == 1
        assert row["roofline_fraction"] > 0
    ours, hf = report["results"]
    assert ours["compile_cold_s"] > 0 and ours["compile_warm_s"] > 0
    assert "hf" in ours["vs"]
    # Same weights, f32, greedy: HF agrees with us token for token.
    assert hf["agreement"]["matching_new_tokens"] == [report["workload"]["new_tokens"]]
    assert {b["bucket"] for b in report["buckets"]} == {128, 256}
    assert (out / "bench.md").read_text().startswith("# pyhlo bench")
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("peer", ["llama-server", "llamacpp"])
def test_the_serving_table_puts_pyhlo_beside_llama_cpp(peer):
    from tools.bench.serve import table

    rows = [{"engine": engine, "clients": clients, "requests": 8, "tokens": 512, "seconds": 4.0,
             "tokens_per_s": rate, "ttft_p50_ms": 50.0, "ttft_p95_ms": 90.0}
            for engine, clients, rate in (("pyhlo", 4, 300.0), (peer, 4, 150.0), ("pyhlo", 8, 400.0))]
    text = table(rows).splitlines()
    assert text[0].endswith(f"| pyhlo vs {peer} tok/s |")
    assert text[2].startswith("| pyhlo | 4 |") and text[2].endswith("| 2.00x |")
    assert text[3].startswith(f"| {peer} | 4 |") and text[4].endswith("|  |")      # no peer row at 8 clients


def test_a_server_that_is_not_found_is_left_out_saying_how_to_get_it(monkeypatch, tmp_path):
    from tools.bench import llama_cpp_programs, serve

    monkeypatch.setenv("PYHLO_MODEL_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv(llama_cpp_programs.BIN_ENV, raising=False)
    monkeypatch.delenv("PYHLO_VLLM_PYTHON", raising=False)             # vLLM, where installed, joins too
    servers, left_out = serve.resolve_servers(None)
    assert servers == ["pyhlo"]
    assert "pyhlo bench --build-llama-cpp" in left_out["llama-server"]
    program = tmp_path / "bin" / "llama-server"
    program.parent.mkdir()
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    monkeypatch.setenv(llama_cpp_programs.BIN_ENV, str(program.parent))
    assert serve.resolve_servers(None) == (["pyhlo", "llama-server"], {})
    command = llama_cpp_programs.server_command(tmp_path / "m.gguf", 8080, 8, 1024, 2)
    assert command[:3] == [str(program), "--model", str(tmp_path / "m.gguf")]
    assert command[command.index("--parallel") + 1] == "8"
    assert command[command.index("--ctx-size") + 1] == "8192"      # 8 slots of 1024 positions
    with pytest.raises(ValueError, match="'sglang' is not one of pyhlo, pyhlo-x8, llama-server, llamacpp"):
        serve.resolve_servers("pyhlo,sglang")


def test_the_speculative_table_gives_each_prompt_and_the_median():
    from tools.bench.speculative import table

    prompts = [{"prompt_tokens": 30, "new_tokens": 128, "target_tokens_per_s": 20.0,
                "speculative_tokens_per_s": 30.0, "same_tokens": True, "target_calls": 40,
                "acceptance_rate": 0.75},
               {"prompt_tokens": 25, "new_tokens": 128, "target_tokens_per_s": 22.0,
                "speculative_tokens_per_s": 22.0, "same_tokens": False, "target_calls": 60,
                "acceptance_rate": 0.4}]
    result = {"prompts": prompts, "target_tokens_per_s": 21.0, "speculative_tokens_per_s": 26.0,
              "speed_up": 26.0 / 21.0, "acceptance_rate": 0.57, "all_same_tokens": False}
    text = table(result).splitlines()
    assert text[2] == "| 30 | 128 | 20.0 | 30.0 | 1.50x | 0.75 | yes |"
    assert text[3].endswith("| 1.00x | 0.40 | NO |")
    assert text[4] == "| median | | 21.0 | 26.0 | 1.24x | 0.57 | NO |"


# -- the device benchmark: pyhlo, HF eager and HF static cache + torch.compile ----------------
DEVICE_ENGINES = ("pyhlo", "hf", "hf-compiled")


@pytest.fixture(scope="module")
def device_run(tmp_path_factory):
    """`pyhlo bench --device cpu` on the tiny random model, batch 1 and 2: (exit code, stdout, report)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("device-bench")
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
        patch.setenv("PYHLO_MODEL_DIR", str(tmp_path_factory.mktemp("random-models")))
        code = main(["bench", "--device", "cpu", "--random-model", "tiny", "--engines",
                     ",".join(DEVICE_ENGINES), "--batch", "1,2", "--prompt-tokens", "8", "--new-tokens", "6",
                     "--repeats", "1", "--quiet-wait", "0", "--out", str(out)])
    return code, printed.getvalue(), json.loads((out / "bench_device.json").read_text()), out


def test_device_run_has_a_row_of_positive_numbers_per_engine_and_batch(device_run):
    code, printed, report, out = device_run
    assert code == 0
    header = next(line for line in printed.splitlines() if line.startswith("| engine"))
    assert [c.strip() for c in header.strip("|").split("|")] == list(bench_report.DEVICE_TABLE_COLUMNS)
    assert report["schema"] == bench_report.DEVICE_SCHEMA
    assert [(r["engine"], r["amp"], r["batch"]) for r in report["results"]] == [
        (engine, "f32", batch) for batch in (1, 2) for engine in DEVICE_ENGINES]
    for row in report["results"]:
        assert row["status"] == "ok", row["error"]
        for key in ("ttft_ms", "decode_tokens_per_s", "ms_per_step"):
            assert row[key]["median"] > 0, key
        assert row["roofline_fraction"] > 0
        assert (row["compile_s"] is None) == (row["engine"] == "hf")   # pyhlo's to_neuron, torch.compile's
                                                                       # warm-up
        assert row["compile_s"] is None or row["compile_s"] > 0
    assert report["bandwidth"]["gb_per_s"] > 0 and report["machine"]["device_name"]
    assert report["floor"]["f32"]["floor_ms"] > 0
    ours = [r for r in report["results"] if r["engine"] == "pyhlo"]
    assert all(set(r["vs"]) == {"hf", "hf-compiled"} for r in ours)
    assert "pyhlo ÷ HF static cache + torch.compile" in printed
    assert (out / "bench_device.md").read_text().startswith("# pyhlo bench --device cpu")


def test_device_run_engines_agree_on_every_greedy_token_in_f32(device_run):
    # The same random weights, f32, greedy: HF eager and compiled pick pyhlo's tokens.
    _, _, report, _ = device_run
    for batch in (1, 2):
        tokens = {r["engine"]: r["tokens"] for r in report["results"] if r["batch"] == batch}
        assert [len(line) for line in tokens["pyhlo"]] == [6] * batch
        assert tokens["hf"] == tokens["pyhlo"] and tokens["hf-compiled"] == tokens["pyhlo"]
        for row in report["results"]:
            if row["batch"] == batch and row["engine"] != "pyhlo":
                assert row["agreement"]["matching_new_tokens"] == [6] * batch


def test_device_cuda_without_a_gpu_fails_at_once_naming_what_to_install(tmp_path, capsys):
    if machine.torch_cuda_problem() is None and machine.jax_cuda_problem(str(worker.ROOT)) is None:
        pytest.skip("torch and jax both see a CUDA GPU here")
    out = tmp_path / "results"
    assert main(["bench", "--device", "cuda", "--random-model", "tiny", "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert "--device cuda needs an NVIDIA GPU" in error and "nothing falls back to the CPU" in error
    assert "download.pytorch.org" in error or "pip install -e '.[cuda]'" in error
    assert not out.exists()                                   # stopped before any model or measurement


def test_device_floor_counts_the_bytes_pyhlo_declares(tiny_llama):
    for variant in ("mha", "gqa_tied_llama3"):                 # separate LM head; LM head tied to the
                                                               # embedding
        _, path = tiny_llama(variant, "safetensors")
        assert device.weight_bytes(path, "f32") == cpu.weight_bytes(path, "f32", 256), variant
        assert device.weight_bytes(path, "bf16") * 2 == device.weight_bytes(path, "f32")


def test_device_options_have_their_own_defaults_and_checks():
    parser = bench_parser()
    settings = device.resolve_settings(parser.parse_args(["--device", "cuda"]))
    assert (settings["amps"], settings["batches"], settings["n_positions"]) == (["bf16"], [1, 8], 256)
    assert settings["device"] == "cuda" and not settings["buckets"]
    assert device.resolve_settings(parser.parse_args(["--device", "cpu"]))["amps"] == ["f32"]
    with pytest.raises(ValueError, match="not 's8'"):
        device.resolve_settings(parser.parse_args(["--device", "cpu", "--amp", "s8"]))
    with pytest.raises(ValueError, match="not 'llamacpp'"):
        device.resolve_engines("pyhlo,llamacpp")
    with pytest.raises(ValueError, match="not both"):
        device.resolve_model(parser.parse_args(["--device", "cpu", "--model", "m", "--random-model", "tiny"]))
    with pytest.raises(ValueError, match="--amp gguf runs a GGUF model's weights as stored; .* not a .gguf"):
        command.run(parser.parse_args(["--random-model", "tiny", "--amp", "f32,gguf"]))


def test_a_random_model_runs_as_a_gguf_file_of_the_type_asked(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYHLO_MODEL_DIR", str(tmp_path / "models"))
    out = tmp_path / "results"
    code = main(["bench", "--random-model", "tiny-smollm2", "--gguf-type", "q8_0", "--amp", "gguf", "--quick",
                 "--engines", "pyhlo", "--quiet-wait", "0", "--out", str(out)])
    assert code == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["workload"]["model"].startswith("tiny-smollm2-") and report["workload"]["model"].endswith(
        ".q8_0.gguf")
    assert [(r["engine"], r["amp"], r["status"]) for r in report["results"]] == [("pyhlo", "gguf", "ok")]


@pytest.mark.parametrize("argv, message", [
    (["--gguf-type", "q4_0"], "--gguf-type writes a random model as a GGUF file: add --random-model"),
    (["--random-model", "tiny", "--model", "x"], "give --model or --random-model, not both"),
    (["--device", "cpu", "--random-model", "tiny", "--gguf-type", "bf16"], "the device benchmark runs HF"),
])
def test_random_model_options_that_do_not_go_together_are_named(argv, message, tmp_path, capsys):
    assert main(["bench", *argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_bench_structured_measures_the_json_schema_overhead_at_the_batches_asked(monkeypatch, capsys):
    from tools.bench import structured_overhead

    asked = {}

    def measure(model_path, batches, tokens, rounds):
        asked.update(batches=batches, tokens=tokens, rounds=rounds)
        return {(b, "greedy"): {"free_ms": 10.0, "json_schema_ms": 10.5, "grammar_ms": 0.1,
                                "overhead_ab": 0.05, "overhead_grammar": 0.01} for b in batches}

    monkeypatch.setattr(structured_overhead, "measure", measure)
    assert main(["bench", "--structured", "--model", "m.gguf", "--batch", "1,4", "--repeats", "2"]) == 0
    assert asked == {"batches": [1, 4], "tokens": 64, "rounds": 2}
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("batch 1 greedy  : decode step   10.00 ms free")
    assert out[0].endswith("(1.0% of the free step)")
