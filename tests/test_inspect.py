"""`pyhlo inspect`: what a module or a model's programs contain, and the files --dump writes."""
from __future__ import annotations

import re
import shutil
import textwrap

import pytest

from pyhlo import compile_py_func
from pyhlo.schema import hlo_pb2
from tools.cli import main
from tools.hlo_report import DOT_MISSING, human_bytes, human_count

MATMUL = {"lhs_contracting_dimensions": [1], "rhs_contracting_dimensions": [0]}


def accumulate(scribe):
    """acc += exp(x @ w), with acc updated in place (aliased to output {0}); also returns tanh(x)."""
    f32 = scribe.f32
    x = f32[4, 8].Parameter(parameter_number=0, parameter_name="x")
    w = f32[8, 3].Parameter(parameter_number=1, parameter_name="w")
    acc = f32[4, 3].Parameter(parameter_number=2, parameter_name="acc")
    product = f32[4, 3].Dot(x, w, dot_dimension_numbers=MATMUL)
    total = f32[4, 3].Add(acc, f32[4, 3].Exp(product))
    total.set_alias_to(acc, must=True)
    return [total, f32[4, 8].Tanh(x)]


@pytest.fixture
def module_pb(tmp_path):
    path = tmp_path / "accumulate.pb"
    path.write_bytes(compile_py_func(accumulate).SerializeToString())
    return path


def inspect(capsys, *argv) -> tuple[int, str, str]:
    code = main(["inspect", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def row(out: str, first_cell: str) -> list[str]:
    """The cells of the table row that starts with `first_cell`."""
    for line in out.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] == first_cell:
            return cells
    raise AssertionError(f"no row {first_cell!r} in:\n{out}")


def test_module_pb_shows_text_opcodes_parameters_and_cost(module_pb, capsys):
    code, out, _ = inspect(capsys, module_pb)
    assert code == 0
    assert "=== module accumulate: 8 instructions in 1 computation" in out
    # (a) XLA's own HLO text
    assert "=== HLO text ===" in out
    assert "HloModule accumulate" in out and "dot(%x, %w)" in out and "exponential(" in out
    # (b) instructions by opcode, most frequent first
    assert "=== instructions by opcode ===" in out
    assert row(out, "parameter")[1:] == ["3", "37.5%"]
    assert row(out, "dot")[1] == "1"
    assert out.index("\nparameter ") < out.index("\ndot ")
    # (c) parameters with bytes, outputs, and the in-place update
    assert row(out, "0") == ["0", "x", "f32[4,8]", "128 B"]
    assert row(out, "2") == ["2", "acc", "f32[4,3]", "48 B", "output {0}"]
    assert row(out, "{1}") == ["{1}", "f32[4,8]", "128 B"]
    assert "output {0} <- parameter 2 (acc), must alias" in out
    # (d) XLA's cost analysis: the dot alone is 2 * 4 * 3 * 8 flops; exp and tanh are transcendental
    flops = int(row(out, "flops")[2].replace(",", ""))
    assert flops >= 2 * 4 * 3 * 8
    assert row(out, "transcendentals")[1] == str(4 * 3 + 4 * 8)
    assert row(out, "bytes accessed")[1].endswith(" B")


def test_section_picks_what_is_shown(module_pb, capsys):
    code, out, _ = inspect(capsys, module_pb, "--section", "opcodes,cost")
    assert code == 0
    assert "=== instructions by opcode ===" in out and "=== cost analysis" in out
    assert "=== HLO text ===" not in out and "=== parameters and outputs ===" not in out


def test_python_file_target_builds_the_function(tmp_path, capsys):
    source = tmp_path / "double.py"
    source.write_text(textwrap.dedent("""
        def double(scribe):
            x = scribe.f32[16].Parameter(parameter_number=0, parameter_name="x")
            return scribe.f32[16].Add(x, x)
    """))
    code, out, _ = inspect(capsys, f"{source}:double")
    assert code == 0
    assert "HloModule double" in out and "add(%x, %x)" in out
    assert row(out, "0") == ["0", "x", "f32[16]", "64 B"]


def test_big_module_hides_its_text_unless_asked(tmp_path, capsys):
    source = tmp_path / "chain.py"
    source.write_text(textwrap.dedent("""
        def chain(scribe):
            x = scribe.f32[8].Parameter(parameter_number=0)
            for _ in range(310):
                x = scribe.f32[8].Negate(x)
            return x
    """))
    code, out, _ = inspect(capsys, f"{source}:chain")
    assert code == 0
    assert "=== HLO text ===" not in out
    assert "HLO text not shown: 311 instructions > 300; add --section text" in out
    assert row(out, "negate")[1] == "310"

    code, out, _ = inspect(capsys, f"{source}:chain", "--section", "text")
    assert code == 0 and "=== HLO text ===" in out and out.count("negate(") == 310


def test_model_lists_every_program_and_memory_totals(tiny_llama, capsys):
    from decoders import LlamaForSampling, NeuronConfig

    hf_model, path = tiny_llama("mha", "safetensors")
    code, out, _ = inspect(capsys, path, "--n-positions", "256", "--per-block")
    assert code == 0

    model = LlamaForSampling.from_pretrained(path, n_positions=256,
                                             neuron_config=NeuronConfig(whole_model_program=False))
    names = [model.programs.build(key).name for key in model.eager_programs()]
    assert "block_n1_s256" in names and "block_n128_s128" in names
    assert f"=== programs ({len(names)}, as model.eager_programs() lists them) ===" in out
    for name in names:
        cells = row(out, name)
        assert len(cells) == 9 and int(cells[1]) > 0, cells
    assert row(out, "block_n1_s256")[2] == "12"  # hidden, positions, slot, pad, 2 caches, 6 weights

    # weights: every tensor of the checkpoint;
    # KV cache: 2 x layers x batch x kv heads x positions x head_dim x 4 B
    weights = sum(p.numel() for p in hf_model.parameters()) * 4
    config = hf_model.config
    head_dim = config.hidden_size // config.num_attention_heads
    kv_cache = 2 * config.num_hidden_layers * 1 * config.num_key_value_heads * 256 * head_dim * 4
    assert row(out, "weights")[1] == human_bytes(weights)
    assert row(out, "KV cache")[1:] == [human_bytes(kv_cache),
                                        "2 x 2 layers x batch 1 x 4 kv heads x 256 positions "
                                        "x head_dim 16 x 4 B"]
    assert row(out, "total")[1] == human_bytes(weights + kv_cache)


def test_model_program_is_shown_like_a_module(tiny_llama, capsys):
    _, path = tiny_llama("mha", "safetensors")
    code, out, _ = inspect(capsys, path, "--n-positions", "256", "--per-block", "--program", "block_n1_s256",
                           "--section", "params")
    assert code == 0
    assert "=== module block_n1_s256:" in out
    assert row(out, "4") == ["4", "cache_k", "f32[1,4,256,16]", "64.0 KiB", "output {1}"]
    assert "output {2} <- parameter 5 (cache_v), must alias" in out


def test_dump_writes_pb_text_and_dot_of_a_module(module_pb, tmp_path, capsys):
    out_dir = tmp_path / "dump"
    code, out, _ = inspect(capsys, module_pb, "--section", "cost", "--dump", out_dir)
    assert code == 0
    assert f"wrote {out_dir / 'accumulate'}.{{pb,txt,dot}}" in out
    assert hlo_pb2.HloModuleProto.FromString((out_dir / "accumulate.pb").read_bytes()) == \
        hlo_pb2.HloModuleProto.FromString(module_pb.read_bytes())
    assert (out_dir / "accumulate.txt").read_text().startswith("HloModule accumulate")
    assert (out_dir / "accumulate.dot").read_text().startswith("digraph")


def test_dump_writes_every_program_of_a_model(tiny_llama, tmp_path, capsys):
    from decoders import LlamaForSampling

    _, path = tiny_llama("mha", "safetensors")
    out_dir = tmp_path / "programs"
    code, _, _ = inspect(capsys, path, "--n-positions", "256", "--dump", out_dir)
    assert code == 0
    model = LlamaForSampling.from_pretrained(path, n_positions=256)
    for key in model.eager_programs():
        program = model.programs.build(key)
        assert (hlo_pb2.HloModuleProto.FromString((out_dir / f"{program.name}.pb").read_bytes())
                == program.module)
        assert (out_dir / f"{program.name}.txt").read_text().startswith(f"HloModule {program.name}")
        assert (out_dir / f"{program.name}.dot").is_file()


@pytest.mark.skipif(shutil.which("dot") is None,
                    reason="Graphviz 'dot' is not installed (apt-get install graphviz)")
def test_svg_and_png_are_rendered_with_graphviz(module_pb, tmp_path, capsys):
    out_dir = tmp_path / "graphs"
    code, out, err = inspect(capsys, module_pb, "--section", "cost", "--dump", out_dir, "--svg", "--png")
    assert code == 0, err
    assert "<svg" in (out_dir / "accumulate.svg").read_text()
    assert (out_dir / "accumulate.png").read_bytes().startswith(b"\x89PNG")


def test_without_graphviz_the_dot_files_are_still_written(module_pb, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    out_dir = tmp_path / "graphs"
    code, _, err = inspect(capsys, module_pb, "--section", "cost", "--dump", out_dir, "--png")
    assert code == 0
    assert DOT_MISSING in err
    assert "install graphviz (apt-get install graphviz)" in err
    assert (out_dir / "accumulate.dot").is_file() and not (out_dir / "accumulate.png").exists()


def test_bad_targets_exit_2_with_a_clear_message(tmp_path, capsys):
    code, _, err = inspect(capsys, tmp_path / "missing.pb")
    assert code == 2 and "missing.pb: no such file or directory" in err

    source = tmp_path / "ops.py"
    source.write_text("def double(scribe):\n    pass\n")
    code, _, err = inspect(capsys, f"{source}:missing_function")
    assert code == 2
    assert "has no function 'missing_function'; functions defined there: double" in err

    not_a_module = tmp_path / "junk.pb"
    not_a_module.write_bytes(b"not a protobuf")
    code, _, err = inspect(capsys, not_a_module)
    assert code == 2 and "is not a serialized HloModuleProto" in err


def test_unknown_program_names_the_programs_there_are(tiny_llama, capsys):
    _, path = tiny_llama("mha", "safetensors")
    code, _, err = inspect(capsys, path, "--n-positions", "256", "--per-block", "--program", "block_n9")
    assert code == 2
    listed = err.split("no program 'block_n9'; this model's programs: ", 1)[1].split("\n")[0].split(", ")
    # a decode block program per cache bucket where attention reads up to the bucket (XLA's
    # own attention), one for the whole cache with pyhlo's decode attention kernel; the
    # samplers first (sample()'s default top_k of 50 draws from up to 64 candidates)
    assert listed[:4] == ["greedy", "sample_k64", "embed_n1", "lm_head_n1"] and "block_n1_s256" in listed
    assert "block_n128_s128" in listed and "block_n9" not in listed


# -- cost: XLA's estimate, where the platform has none, and the work inside pyhlo's kernels --
def test_cost_analysis_comes_from_xla_cpu_where_the_platform_has_none(monkeypatch):
    import jax

    from runtime import pjrt
    from tools.hlo_report import format_module, module_report

    platforms_asked = []
    own_analysis = pjrt.client_cost_analysis

    def without_cuda_analysis(proto_bytes, platform):
        platforms_asked.append(platform)
        if platform == "cuda":  # as jax's CUDA plugin answers through the PJRT C API
            raise jax.errors.JaxRuntimeError("UNIMPLEMENTED: GetHloCostAnalysis is not implemented")
        return own_analysis(proto_bytes, platform)

    monkeypatch.setattr(pjrt, "client_cost_analysis", without_cuda_analysis)
    module_bytes = compile_py_func(accumulate).SerializeToString()
    report = module_report(module_bytes, cost=lambda data: pjrt.cost_analysis(data, "cuda"))
    out = format_module(report, ["cost"])
    assert platforms_asked == ["cuda", "cpu"]
    assert int(row(out, "flops")[2].replace(",", "")) >= 2 * 4 * 3 * 8
    assert row(out, "transcendentals")[1] == str(4 * 3 + 4 * 8)
    assert ("cost analysis: XLA:cpu's, the cuda client has none "
            "(UNIMPLEMENTED: GetHloCostAnalysis is not implemented)") in out


def test_cost_analysis_on_cpu_says_so_and_does_not_hide_its_failure(monkeypatch):
    from runtime import XlaBackend, pjrt

    module_bytes = compile_py_func(accumulate).SerializeToString()
    assert XlaBackend("cpu").cost_analysis(module_bytes)["analysed by"] == "XLA:cpu"

    def broken(proto_bytes, platform):
        raise RuntimeError("no analysis")

    monkeypatch.setattr(pjrt, "client_cost_analysis", broken)
    with pytest.raises(RuntimeError, match="no analysis"):
        pjrt.cost_analysis(module_bytes, "cpu")


def test_kernel_work_is_added_to_xla_figures(tmp_path, capsys):
    source = tmp_path / "product.py"
    source.write_text(textwrap.dedent("""
        from pyhlo.ops import linalg

        def product(scribe):
            x = scribe.f32[2, 576].Parameter(parameter_number=0, parameter_name="x")
            w = scribe.bf16[1536, 576].Parameter(parameter_number=1, parameter_name="w")
            return linalg.matvec_kernel(x, w)
    """))
    code, out, _ = inspect(capsys, f"{source}:product", "--section", "cost")
    assert code == 0
    # XLA sees parameters and a call of unknown work: the whole figure is the kernel's
    flops, accessed = 2 * 2 * 576 * 1536, 1536 * 576 * 2 + 2 * 576 * 4 + 2 * 1536 * 4
    assert row(out, "flops")[2:] == [f"{flops:,}", "0 FLOP", human_count(flops, "FLOP")]
    assert row(out, "bytes accessed")[2:] == [f"{accessed:,} B", "0 B", human_bytes(accessed)]
    assert "cost analysis: XLA:cpu" in out
    assert "counted from their shapes: pyhlo_matvec x 1" in out
    assert "upper bound" not in out


def _count(text: str) -> float:
    """'360.4 KFLOP' or '360.4 K' -> 360400.0"""
    number, _, unit = text.partition(" ")
    return float(number) * 1000 ** " KMGTP".index((unit or " ")[0])


@pytest.mark.cpu_only
def test_decode_program_reports_the_kernels_work(tiny_llama, capsys):
    from runtime import cpu_kernels

    assert cpu_kernels.register(), "the CPU kernels did not build"
    hf_model, path = tiny_llama("mha", "safetensors")
    config = hf_model.config
    n_positions, layers, hidden = 256, config.num_hidden_layers, config.hidden_size
    code, out, _ = inspect(capsys, path, "--n-positions", n_positions, "--program",
                           f"model_n1_s{n_positions}", "--section", "cost")
    assert code == 0
    # One token: every weight of the kernels' products is one multiply-add (2 flops), and so,
    # with as many kv heads as heads, is every element of the K and V caches (q.k, then p.v).
    linear_weights = sum(p.numel() for name, p in hf_model.named_parameters()
                         if name.endswith("proj.weight") or name == "lm_head.weight")
    kv_caches = 2 * layers * config.num_key_value_heads * n_positions * (hidden // config.num_attention_heads)
    assert config.num_key_value_heads == config.num_attention_heads
    flops = row(out, "flops")
    assert _count(flops[4].rstrip("*")) == pytest.approx(2 * (linear_weights + kv_caches), rel=0.01)
    assert flops[4].endswith("*") and "pyhlo_decode_attention counted over the whole KV cache" in out
    assert "pyhlo_matvec x " in out
