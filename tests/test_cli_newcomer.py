"""The command line as a newcomer types it: --version, -v after the command, the spellings HF,
vLLM and llama.cpp users know (-m / --model / a positional model, --dtype, --max-model-len,
--tp-degree), --stop, and phase lines for the slow first-run steps without -v."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from child_env import python_path
from tiny_families import make_model, save
from tiny_tokenizer import make_tokenizer

from decoders import NeuronAutoModelForCausalLM
from serving.stop_strings import cut_at_stop, held_back
from tools import cli
from tools.generate import model_before_options, stop_streamer
from tools.model_options import model_path

REPO = Path(__file__).resolve().parent.parent


def parse(*argv: str):
    return cli.build_parser().parse_args(list(argv))


@pytest.mark.quick
def test_version_and_every_help_page(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("pyhlo ")
    for argv in (["--help"], *([name, "--help"] for name in cli.COMMANDS)):
        with pytest.raises(SystemExit) as done:
            cli.main(argv)
        assert done.value.code == 0, argv
        assert "usage: pyhlo" in capsys.readouterr().out


@pytest.mark.quick
def test_verbose_before_or_after_the_command():
    assert parse("-v", "generate", "hi").verbose
    assert parse("generate", "-v", "hi").verbose
    assert parse("generate", "hi", "--verbose").verbose
    assert parse("-v", "generate", "hi").verbose      # a -v before is not undone by the command's default
    assert not parse("generate", "hi").verbose


@pytest.mark.quick
def test_hf_vllm_and_llama_cpp_spellings_are_aliases():
    args = parse("generate", "-m", "model.gguf", "--dtype", "bfloat16", "--max-model-len", "512",
                 "--tp-degree", "2", "--stop", ".", "--stop", "\n", "hi")
    assert (model_path(args), args.amp, args.n_positions, args.tp_degree, args.stop, args.prompt) == \
        ("model.gguf", "bf16", 512, 2, [".", "\n"], "hi")
    args = parse("generate", "--model", "dir", "--amp", "f16", "--n-positions", "256", "hi")
    assert (model_path(args), args.amp, args.n_positions) == ("dir", "f16", 256)
    args = parse("generate", "dir", "hi")                     # MODEL PROMPT
    assert (model_path(args), args.prompt) == ("dir", "hi")
    args = parse("generate", "hi")
    assert (model_path(args), args.prompt, args.amp, args.n_positions, args.tp_degree) == \
        (None, "hi", "f32", 1024, 1)
    for command in (["inspect"], ["compile", "--dump", "out"]):      # the shared model options
        args = parse(*command, "default", "--dtype", "float16", "--max-model-len", "256")
        assert (args.amp, args.n_positions) == ("f16", 256)
    with pytest.raises(SystemExit):
        parse("generate", "--dtype", "float64", "hi")


@pytest.mark.quick
def test_model_before_the_options_is_read_as_the_model():
    args, extras = cli.build_parser().parse_known_args(["generate", "dir", "--chat", "hi"])
    model_before_options(args, extras)
    assert (model_path(args), args.prompt, args.chat) == ("dir", "hi", True)
    args = parse("generate", "a", "hi", "--model", "b")
    with pytest.raises(ValueError, match="two models given"):
        model_path(args)


@pytest.mark.quick
def test_unknown_arguments_are_still_errors(capsys):
    assert cli.main(["generate", "dir", "hi", "more", "--no-such-flag"]) == 2
    assert "unrecognized arguments" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        cli.main(["inspect", "default", "--no-such-flag"])
    assert done.value.code == 2


@pytest.mark.quick
def test_logging_shows_phase_lines_always_pyhlo_with_v_and_not_jax_info():
    try:
        cli.configure_logging(verbose=False)
        assert logging.getLogger("pyhlo.progress").isEnabledFor(logging.INFO)
        assert not logging.getLogger("pyhlo").isEnabledFor(logging.INFO)
        cli.configure_logging(verbose=True)
        assert logging.getLogger("pyhlo").isEnabledFor(logging.INFO)
        # jax's note that it found no TPU is an INFO record: hidden with -v too.
        assert not logging.getLogger("jax._src.xla_bridge").isEnabledFor(logging.INFO)
    finally:
        logging.getLogger("pyhlo").setLevel(logging.NOTSET)
        logging.getLogger("pyhlo.progress").setLevel(logging.NOTSET)


@pytest.mark.quick
def test_stop_strings_cut_the_text_and_hold_back_what_may_begin_one(capsys):
    assert cut_at_stop("Paris. Next", [".", "Next"]) == 5
    assert cut_at_stop("Paris", ["."]) is None
    assert held_back("Hello wo", ["world"]) == 2 and held_back("Hello", ["world"]) == 0
    tokenizer = make_tokenizer()
    streamer = stop_streamer(tokenizer, ["t9 t"])
    streamer.put(torch.tensor([[1, 2, 3]]))                     # the prompt: not printed
    for token in (5, 7, 9, 11, 13):
        streamer.put(torch.tensor([tokenizer.convert_tokens_to_ids(f"t{token}")]))
    streamer.end()
    assert streamer.stopped
    assert capsys.readouterr().out.strip() == "t5 t7"


# -- generate on a tiny model ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = save(make_model("gpt_neox"), tmp_path_factory.mktemp("gpt_neox"))
    make_tokenizer().save_pretrained(directory)
    return directory


def greedy_words(path, prompt: str, new_tokens: int) -> list[str]:
    model = NeuronAutoModelForCausalLM.from_pretrained(path, n_positions=128).to_neuron()
    ids = make_tokenizer()(prompt)["input_ids"]
    out = model.sample(torch.tensor([ids]), sequence_length=len(ids) + new_tokens, top_k=1)
    return make_tokenizer().decode(out[0, len(ids):]).split()


def test_generate_stops_at_a_stop_string_which_is_not_printed(checkpoint, capsys):
    prompt = "t5 t17 t42 t8"
    options = ["generate", str(checkpoint), prompt, "--max-model-len", "128", "--max-new-tokens", "8"]
    assert cli.main(options) == 0
    text = capsys.readouterr().out
    assert text.split() == greedy_words(checkpoint, prompt, 8)
    stop = f" {text.split()[3]}"                            # the 4th new token's text (or an earlier one's)
    assert cli.main([*options, "--stop", stop]) == 0
    assert capsys.readouterr().out.rstrip("\n") == text[:text.index(stop)]


def test_generate_with_tp_degree_2_on_cpu_makes_its_devices_and_gives_the_same_text(checkpoint):
    prompt = "t5 t17 t42 t8"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYHLO_PLATFORM="cpu", PYTHONPATH=python_path(REPO))
    done = subprocess.run([sys.executable, "-m", "tools.cli", "generate", "-m", str(checkpoint),
                           "--tp-degree", "2", "--max-model-len", "128", "--max-new-tokens", "6", prompt],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == greedy_words(checkpoint, prompt, 6)


def test_a_compile_the_cache_lacks_says_so_and_a_cached_one_is_not(checkpoint, caplog, monkeypatch, tmp_path):
    monkeypatch.setenv("PYHLO_CACHE_DIR", str(tmp_path))            # an empty compile cache
    with caplog.at_level(logging.INFO, logger="pyhlo.progress"):
        NeuronAutoModelForCausalLM.from_pretrained(checkpoint, n_positions=128).to_neuron()
        said = [r.getMessage() for r in caplog.records if r.name == "pyhlo.progress"]
        assert any(m.startswith("compiling ") and "compile cache keeps them" in m for m in said), said
        caplog.clear()
        NeuronAutoModelForCausalLM.from_pretrained(checkpoint, n_positions=128).to_neuron()
        assert not [r for r in caplog.records if r.name == "pyhlo.progress"]
