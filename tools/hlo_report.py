"""What an HLO module or a model's programs contain: the functions behind `pyhlo inspect`.

    module_bytes = read_module("program.pb")  # or module_from_python("f.py", "fn").SerializeToString()
    report = module_report(module_bytes)      # opcodes, parameters, outputs, aliases, cost
    print(format_module(report, ["opcodes", "params", "cost"]))

    reports = program_reports(model)          # one per program of model.eager_programs()
    print(format_model(model, reports))

    pb, txt, dot = dump_module("out", report)     # out/NAME.pb, .txt, .dot
    render_dot(dot, "svg", graphviz_dot())        # out/NAME.svg (needs Graphviz)

HLO text, Graphviz graphs and cost estimates come from XLA through the runtime, and
the work inside pyhlo's kernels from runtime.kernel_costs (tools/hlo_costs.py adds them
up); nothing here compiles a module.
"""
from __future__ import annotations

import collections
import dataclasses
import importlib.util
import pathlib
import re
import shutil
import subprocess
import sys
from typing import Any, Callable, Sequence

from google.protobuf.message import DecodeError

from pyhlo import dtypes
from pyhlo.schema import hlo_pb2
from runtime.kernel_costs import shape_bytes
from tools.hlo_costs import ModuleCost, format_cost, module_cost, split_text, upper_bound_note
from tools.text_format import format_table, human_bytes, human_count

SECTIONS = ("text", "opcodes", "params", "cost")
SECTION_TITLES = {
    "text": "HLO text",
    "opcodes": "instructions by opcode",
    "params": "parameters and outputs",
    "cost": "cost analysis (XLA's estimate for the unoptimized module + the work in pyhlo's kernels)",
}
# Above this many instructions the HLO text is left out unless asked for.
TEXT_LIMIT = 300
RENDER_FORMATS = ("svg", "png")
DOT_MISSING = ("Graphviz 'dot' not found: install graphviz (apt-get install graphviz) to render; "
               "the .dot files are written")
_ALIAS_KINDS = {hlo_pb2.MAY_ALIAS: "may", hlo_pb2.MUST_ALIAS: "must"}


# -- shapes --------------------------------------------------------------------------
def shape_text(shape: hlo_pb2.ShapeProto) -> str:
    """XLA's spelling without layout: f32[4,8], (f32[2], s32[]), token[]."""
    if shape.element_type == hlo_pb2.TUPLE:
        return "(" + ", ".join(shape_text(s) for s in shape.tuple_shapes) + ")"
    name = dtypes.NAME_OF_PRIMITIVE.get(shape.element_type)
    if name is None:  # token, opaque, or a type our schema subset does not name
        known = shape.element_type in hlo_pb2.PrimitiveType.values()
        name = (hlo_pb2.PrimitiveType.Name(shape.element_type).lower() if known
                else f"type{shape.element_type}")
    return f"{name}[{','.join(map(str, shape.dimensions))}]"


def index_text(index: Sequence[int]) -> str:
    """A shape index as XLA writes it: {} for the whole result, {1} for tuple element 1."""
    return "{" + ",".join(map(str, index)) + "}"


def _leaves(shape: hlo_pb2.ShapeProto, index: tuple[int, ...] = ()):
    if shape.element_type == hlo_pb2.TUPLE:
        for i, element in enumerate(shape.tuple_shapes):
            yield from _leaves(element, index + (i,))
    else:
        yield index, shape


# -- targets -------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Target:
    kind: str                   # "module" (.pb) | "python" (file.py:function) | "model"
    path: pathlib.Path | None   # None for the default model
    function: str = ""


def parse_target(target: str) -> Target:
    """MODULE.pb, path/to/file.py:function, a model directory or .gguf file, or 'default'."""
    if target == "default":
        return Target("model", None)
    filename, colon, function = target.rpartition(":")
    if colon and filename.endswith(".py"):
        if not pathlib.Path(filename).is_file():
            raise FileNotFoundError(f"{filename}: no such file")
        if not function:
            raise ValueError(f"{target}: name the function to build, as {filename}:function")
        return Target("python", pathlib.Path(filename), function)
    path = pathlib.Path(target)
    if target.endswith(".py"):
        raise ValueError(f"{target}: name the function that writes the module, as {target}:function")
    if not path.exists():
        raise FileNotFoundError(
            f"{target}: no such file or directory; a target is MODULE.pb, path/to/file.py:function, "
            "a model directory or .gguf file, or 'default'"
        )
    if path.is_file() and path.suffix == ".pb":
        return Target("module", path)
    if path.is_dir() or path.suffix == ".gguf":
        return Target("model", path)
    raise ValueError(f"{target}: not a .pb module, a file.py:function, a model directory or a .gguf file")


# -- one module ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Parameter:
    number: int
    name: str
    shape: str
    bytes: int


@dataclasses.dataclass(frozen=True)
class Output:
    index: tuple[int, ...]
    shape: str
    bytes: int


@dataclasses.dataclass(frozen=True)
class Alias:
    """Output `output_index` reuses the memory of parameter `parameter` (updated in place)."""

    output_index: tuple[int, ...]
    parameter: int
    parameter_index: tuple[int, ...]
    kind: str  # "must" | "may"


@dataclasses.dataclass(frozen=True)
class ModuleReport:
    name: str
    module_bytes: bytes = dataclasses.field(repr=False)
    computations: int
    instructions: int
    opcodes: list[tuple[str, int]]  # most frequent first
    parameters: list[Parameter]
    outputs: list[Output]
    aliases: list[Alias]
    cost: ModuleCost  # XLA's estimate (cost.xla) and the work of pyhlo's kernel calls

    @property
    def parameter_bytes(self) -> int:
        return sum(p.bytes for p in self.parameters)

    @property
    def output_bytes(self) -> int:
        return sum(o.bytes for o in self.outputs)

    @property
    def flops(self) -> float:
        """XLA's figure + the kernels'."""
        return self.cost.total("flops")

    @property
    def bytes_accessed(self) -> float:
        """XLA's figure + the kernels'."""
        return self.cost.total("bytes accessed")


def parse_module(module_bytes: bytes, source: str = "module") -> hlo_pb2.HloModuleProto:
    """The HloModuleProto in `module_bytes`, or ValueError saying what `source` is not."""
    try:
        module = hlo_pb2.HloModuleProto.FromString(module_bytes)
    except DecodeError as error:
        raise ValueError(f"{source} is not a serialized HloModuleProto ({error})") from None
    if not module.computations:
        raise ValueError(f"{source} is not a serialized HloModuleProto (it has no computations)")
    return module


def read_module(path: str | pathlib.Path) -> bytes:
    """The bytes of a serialized HloModuleProto file, checked to parse."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    data = path.read_bytes()
    parse_module(data, str(path))
    return data


def module_from_python(path: str | pathlib.Path, function_name: str) -> hlo_pb2.HloModuleProto:
    """Import the file at `path` and write `compile_py_func(function)` (the function takes the scribe)."""
    from pyhlo import compile_py_func

    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    module_name = "_pyhlo_inspect_" + re.sub(r"\W", "_", path.stem)
    import_spec = importlib.util.spec_from_file_location(module_name, path)
    python_module = importlib.util.module_from_spec(import_spec)
    # The file may import its neighbours.
    sys.path.insert(0, str(path.resolve().parent))
    try:
        import_spec.loader.exec_module(python_module)
    finally:
        sys.path.pop(0)
    function = getattr(python_module, function_name, None)
    if not callable(function):
        defined = sorted(n for n, v in vars(python_module).items()
                         if callable(v) and getattr(v, "__module__", None) == module_name)
        raise ValueError(f"{path} has no function {function_name!r}; functions defined there: "
                         f"{', '.join(defined) or '(none)'}")
    return compile_py_func(function)


def module_report(module_bytes: bytes, name: str | None = None,
                  cost: Callable[[bytes], dict[str, float | str]] | None = None) -> ModuleReport:
    """Counts, shapes, aliases and cost of a serialized module (nothing is compiled): XLA's
    estimate by `cost` (default cost_analysis) and the work of pyhlo's kernel calls."""
    module = parse_module(module_bytes)
    opcodes = collections.Counter(i.opcode for c in module.computations for i in c.instructions)
    program_shape = module.host_program_shape
    names = list(program_shape.parameter_names)
    if len(names) != len(program_shape.parameters):
        names = [f"p{i}" for i in range(len(program_shape.parameters))]
    parameters = [Parameter(i, n, shape_text(s), shape_bytes(s))
                  for i, (n, s) in enumerate(zip(names, program_shape.parameters))]
    outputs = [Output(index, shape_text(s), shape_bytes(s)) for index, s in _leaves(program_shape.result)]
    aliases = [Alias(tuple(e.output_shape_index), e.parameter_number, tuple(e.parameter_shape_index),
                     _ALIAS_KINDS.get(e.kind, "may"))
               for e in module.input_output_alias.entries]
    return ModuleReport(
        name=name or module.name or "module",
        module_bytes=module_bytes,
        computations=len(module.computations),
        instructions=sum(opcodes.values()),
        opcodes=sorted(opcodes.items(), key=lambda item: (-item[1], item[0])),
        parameters=parameters,
        outputs=outputs,
        aliases=aliases,
        cost=module_cost(module, (cost or cost_analysis)(module_bytes)),
    )


def analysis_backend(backend: Any = None) -> Any:
    """A backend that can estimate costs: `backend` (default get_backend()) if it can, else XLA on cpu."""
    from runtime.backend import XlaBackend
    from runtime.select import get_backend

    backend = backend if backend is not None else get_backend()
    return backend if hasattr(backend, "cost_analysis") else XlaBackend("cpu")


def cost_analysis(module_bytes: bytes) -> dict[str, float | str]:
    """XLA's flops / transcendentals / bytes-accessed estimate of the unoptimized module."""
    return analysis_backend().cost_analysis(module_bytes)


def hlo_text(module_bytes: bytes) -> str:
    from runtime import pjrt

    return pjrt.hlo_text(module_bytes)


def default_sections(report: ModuleReport) -> list[str]:
    """Every section, less the HLO text of a module with more than TEXT_LIMIT instructions."""
    if report.instructions > TEXT_LIMIT:
        return [s for s in SECTIONS if s != "text"]
    return list(SECTIONS)


def _header(title: str) -> str:
    return f"=== {title} ==="


def _format_opcodes(report: ModuleReport) -> str:
    total = report.instructions
    rows = [(op, n, f"{100 * n / total:.1f}%") for op, n in report.opcodes]
    rows.append(("total", total, "100.0%"))
    return format_table(["opcode", "count", "share"], rows, right=(1, 2))


def _format_params(report: ModuleReport) -> str:
    by_parameter = {a.parameter: a for a in report.aliases}
    by_output = {a.output_index: a for a in report.aliases}
    names = {p.number: p.name for p in report.parameters}
    params = [(p.number, p.name, p.shape, human_bytes(p.bytes),
               f"output {index_text(by_parameter[p.number].output_index)}" if p.number in by_parameter
               else "")
              for p in report.parameters]
    params.append(("", "total", "", human_bytes(report.parameter_bytes), ""))
    outputs = []
    for o in report.outputs:
        alias = by_output.get(o.index)
        source = f"parameter {alias.parameter} ({names.get(alias.parameter, '?')})" if alias else ""
        outputs.append((index_text(o.index), o.shape, human_bytes(o.bytes), source))
    outputs.append(("total", "", human_bytes(report.output_bytes), ""))
    lines = [f"{len(report.parameters)} parameters:",
             format_table(["#", "name", "shape", "bytes", "aliased to"], params, right=(0, 3)),
             "", f"{len(report.outputs)} outputs:",
             format_table(["output", "shape", "bytes", "aliased from"], outputs, right=(2,))]
    lines.append("")
    if report.aliases:
        lines.append("input_output_alias (the output reuses the parameter's memory: updated in place):")
        for a in report.aliases:
            param = f"parameter {a.parameter} ({names.get(a.parameter, '?')})"
            if a.parameter_index:
                param += f" {index_text(a.parameter_index)}"
            lines.append(f"  output {index_text(a.output_index)} <- {param}, {a.kind} alias")
    else:
        lines.append("input_output_alias: none (no output reuses a parameter's memory)")
    return "\n".join(lines)


def format_module(report: ModuleReport, sections: Sequence[str] | None = None) -> str:
    """The chosen sections (default: default_sections(report)) under clear headers."""
    chosen = list(sections) if sections else default_sections(report)
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        raise ValueError(f"unknown section {unknown[0]!r}; sections: {', '.join(SECTIONS)}")
    parts = [_header(f"module {report.name}: {report.instructions} instructions in "
                     f"{report.computations} computation{'s' if report.computations != 1 else ''}, "
                     f"{len(report.parameters)} parameters ({human_bytes(report.parameter_bytes)}), "
                     f"{len(report.outputs)} outputs ({human_bytes(report.output_bytes)})")]
    for section in SECTIONS:
        if section not in chosen:
            continue
        parts.append("")
        parts.append(_header(SECTION_TITLES[section]))
        if section == "text":
            parts.append(hlo_text(report.module_bytes).rstrip())
        elif section == "opcodes":
            parts.append(_format_opcodes(report))
        elif section == "params":
            parts.append(_format_params(report))
        else:
            parts.append(format_cost(report.cost))
    if "text" not in chosen and sections is None:
        parts += ["", f"(HLO text not shown: {report.instructions} instructions > {TEXT_LIMIT}; "
                      "add --section text to print it, or --dump DIR to write NAME.txt)"]
    return "\n".join(parts)


# -- a model's programs --------------------------------------------------------------
def program_reports(model: Any, backend: Any = None) -> list[ModuleReport]:
    """A report of every program `model.eager_programs()` lists (built, not compiled)."""
    analysis = analysis_backend(backend if backend is not None else model.programs.backend)
    reports = []
    for key in model.eager_programs():
        program = model.programs.build(key)
        reports.append(module_report(program.module.SerializeToString(), program.name,
                                     cost=analysis.cost_analysis))
    return reports


@dataclasses.dataclass(frozen=True)
class ModelTotals:
    n_layers: int
    layer_weight_bytes: int
    shared_weight_bytes: int
    kv_cache_bytes: int
    kv_cache_formula: str

    @property
    def weight_bytes(self) -> int:
        return self.layer_weight_bytes * self.n_layers + self.shared_weight_bytes


def model_totals(model: Any) -> ModelTotals:
    """Device memory of the declared weights (layers + shared) and of the KV caches of every layer."""
    from decoders.programs.memory import planned_memory

    builder = model.session.builder
    planned = planned_memory(builder)
    n_layers = planned.n_layers
    cache = builder.cache_spec("cache")   # (batch, kv_heads, n_positions, head_dim)
    size = dtypes.byte_size(cache.dtype)
    formula = (f"2 x {n_layers} layers x batch {cache.dims[0]} x {cache.dims[1]} kv heads x "
               f"{cache.dims[2]} positions x head_dim {cache.dims[3]} x {size} B")
    return ModelTotals(n_layers, planned.layer_weight_bytes, planned.shared_weight_bytes,
                       planned.kv_cache_bytes, formula)


def format_weights(model: Any) -> str:
    """Every declared parameter: program name, layout and type, tensor-parallel axis, checkpoint source."""
    builder = model.session.builder
    rows = []
    for where, params in (("layer", builder.layer_params()), ("shared", builder.shared_params())):
        for param in params:
            spec = builder.spec(param)
            rows.append((where, spec.name, f"{spec.dtype}[{','.join(map(str, spec.dims))}]",
                         param.shard.value, param.source.label))
    return format_table(["", "parameter", "program shape", "shard", "checkpoint ({i}: layer)"], rows)


def _model_cost_notes(reports: Sequence[ModuleReport]) -> str:
    sources = list(dict.fromkeys(r.cost.analysed_by for r in reports if r.cost.analysed_by))
    bounded = list(dict.fromkeys(t for r in reports for t in r.cost.kernels.upper_bound_targets))
    uncounted = sorted({t for r in reports for t in r.cost.kernels.uncounted})
    lines = ["flops, bytes accessed: XLA's estimate for the unoptimized module + the work in pyhlo's kernels "
             "(custom calls XLA cannot see into), counted from their shapes."]
    lines += [f"cost analysis: {source}" for source in sources]
    if bounded:
        lines.append(upper_bound_note(bounded))
    if uncounted:
        lines.append(f"custom calls whose work no figure counts: {', '.join(uncounted)}")
    lines.append("param bytes: device memory of the inputs (weights and caches included); "
                 "aliased outputs reuse their input's memory.")
    return "\n".join(lines)


def format_model(model: Any, reports: Sequence[ModuleReport]) -> str:
    """The model's pieces, a table of its programs, its weights and its memory totals."""
    decoder = model.decoder
    attention, mlp = decoder.layer.attention, decoder.layer.mlp
    positions = type(attention.positions).__name__.lower() if attention.positions is not None else "none"
    windows = [decoder.kinds[decoder.kind_of(i)].attention.window for i in range(decoder.n_layers)]
    windowed = [w for w in windows if w is not None]
    window = (f", sliding window {windowed[0]} on {len(windowed)} of {decoder.n_layers} layers" if windowed
              else "")
    parts = [
        _header(f"model {model.checkpoint_path} ({model.family.name})"),
        f"layers {decoder.n_layers}, hidden {attention.hidden}, heads {attention.n_heads} (kv "
        f"{attention.n_kv_heads}) x head_dim {attention.head_dim}, intermediate {mlp.intermediate}, "
        f"vocab {decoder.head.vocab_size}",
        f"{decoder.layer.input_norm.kind} norm, {'gated ' if mlp.gated else ''}{mlp.activation} MLP, "
        f"{positions} positions{window}, {decoder.layer.residual} residual"
        f"{', tied LM head' if decoder.tied else ''}",
        f"amp {model.amp}, batch {model.batch_size}, n_positions {model.n_positions}; token buckets "
        f"{', '.join(map(str, model.token_buckets))}; context buckets "
        f"{', '.join(map(str, model.context_buckets))}; lowering {model.lowering.name}",
        "",
        _header(f"programs ({len(reports)}, as model.eager_programs() lists them)"),
    ]
    rows = [(r.name, r.instructions, len(r.parameters), human_count(r.flops, "FLOP"),
             split_text(r.cost, "flops"), human_bytes(r.bytes_accessed), split_text(r.cost, "bytes accessed"),
             human_bytes(r.parameter_bytes), human_bytes(r.output_bytes))
            for r in reports]
    parts.append(format_table(["program", "instructions", "params", "flops", "XLA + kernels",
                               "bytes accessed", "XLA + kernels", "param bytes", "output bytes"],
                              rows, right=range(1, 9)))
    parts.append(_model_cost_notes(reports))
    parts += ["", _header("weights (as the pieces declare them)"), format_weights(model)]
    totals = model_totals(model)
    parts += [
        "",
        _header("model totals (device memory)"),
        format_table(["", "bytes", "how"], [
            ("weights", human_bytes(totals.weight_bytes),
             f"{totals.n_layers} layers x {human_bytes(totals.layer_weight_bytes)} + shared "
             f"{human_bytes(totals.shared_weight_bytes)} (embedding, final norm"
             f"{', tied LM head' if decoder.tied else ', LM head'})"),
            ("KV cache", human_bytes(totals.kv_cache_bytes), totals.kv_cache_formula),
            ("total", human_bytes(totals.weight_bytes + totals.kv_cache_bytes), "weights + KV cache"),
        ], right=(1,)),
        "",
        "Show one program like a module with --program NAME; write them all with --dump DIR.",
    ]
    return "\n".join(parts)


# -- files ---------------------------------------------------------------------------
def file_stem(name: str) -> str:
    """A module name made safe as a file name."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "module"


def graphviz_dot() -> str | None:
    """The path of Graphviz's `dot` command, or None when it is not on PATH."""
    return shutil.which("dot")


def render_dot(dot_file: pathlib.Path, fmt: str, dot: str) -> pathlib.Path:
    """Render `dot_file` to the same name with suffix `fmt` (svg | png) with Graphviz's `dot` command."""
    if fmt not in RENDER_FORMATS:
        raise ValueError(f"unknown render format {fmt!r}; formats: {', '.join(RENDER_FORMATS)}")
    out = dot_file.with_name(f"{dot_file.stem}.{fmt}")
    done = subprocess.run([dot, f"-T{fmt}", str(dot_file), "-o", str(out)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"dot -T{fmt} {dot_file} failed: {done.stderr.strip()}")
    return out


def dump_module(directory: str | pathlib.Path, report: ModuleReport) -> list[pathlib.Path]:
    """Write NAME.pb, NAME.txt (HLO text) and NAME.dot (Graphviz); returns the paths, .dot last."""
    from runtime import pjrt

    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stem = directory / file_stem(report.name)
    pb, txt, dot = (stem.with_name(f"{stem.name}{suffix}") for suffix in (".pb", ".txt", ".dot"))
    pb.write_bytes(report.module_bytes)
    txt.write_text(pjrt.hlo_text(report.module_bytes))
    dot.write_text(pjrt.hlo_dot_graph(report.module_bytes))
    return [pb, txt, dot]
