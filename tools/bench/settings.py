"""The settings of a `pyhlo bench` run: explicit options, else --quick's, else the defaults; checked
before anything is measured, so a typo costs no model load."""
from __future__ import annotations

import argparse
import pathlib

from tools.bench import peers

ENGINES = ("pyhlo", "hf", "llamacpp")
AMPS = ("f32", "bf16", "s8", "gguf", "gguf-x8")
DEFAULTS = dict(amp="f32,bf16,s8,gguf,gguf-x8", batch="1,4", prompt_tokens=128, new_tokens=128, repeats=3,
                n_positions=1024, bandwidth_mb=512)
QUICK = dict(amp="f32", batch="1", prompt_tokens=16, new_tokens=8, repeats=1, n_positions=256,
             bandwidth_mb=64)


def csv(value: str) -> list[str]:
    """The non-empty items of a comma-separated option."""
    return [v.strip() for v in value.split(",") if v.strip()]


def resolve_settings(args: argparse.Namespace) -> dict:
    """The run's settings: explicit options, else --quick's, else the defaults; validated."""
    base = QUICK if args.quick else DEFAULTS
    pick = lambda name: getattr(args, name) if getattr(args, name, None) is not None else base[name]  # noqa: E731
    settings = {name: pick(name) for name in ("amp", "batch", "prompt_tokens", "new_tokens", "repeats",
                                              "n_positions")}
    settings["bandwidth_mb"] = base["bandwidth_mb"]
    settings["amps"] = csv(settings.pop("amp"))
    for amp in settings["amps"]:
        if amp not in AMPS:
            raise ValueError(f"--amp {amp!r} is not one of {', '.join(AMPS)}")
    try:
        settings["batches"] = [int(b) for b in csv(settings.pop("batch"))]
    except ValueError as e:
        raise ValueError(f"--batch must be comma-separated integers ({e})") from None
    if not settings["amps"] or not settings["batches"] or min(settings["batches"]) < 1:
        raise ValueError("--amp and --batch need at least one value; batch sizes are >= 1")
    if settings["new_tokens"] < 2:
        raise ValueError("--new-tokens must be at least 2 (decode speed is measured after the first token)")
    if settings["prompt_tokens"] < 1 or settings["repeats"] < 1:
        raise ValueError("--prompt-tokens and --repeats must be at least 1")
    if settings["prompt_tokens"] + settings["new_tokens"] > settings["n_positions"]:
        raise ValueError("--prompt-tokens + --new-tokens "
                         f"({settings['prompt_tokens'] + settings['new_tokens']}) exceeds --n-positions "
                         f"{settings['n_positions']}")
    settings["threads"] = max(1, args.threads)
    settings["compile_times"] = not args.no_compile_times
    settings["buckets"] = not args.no_buckets
    settings["quiet_wait"] = max(0.0, args.quiet_wait)
    settings["kv_cache_dtype"] = getattr(args, "kv_cache_dtype", None)
    return settings


def resolve_engines(requested: str | None) -> tuple[list[str], dict[str, str]]:
    """Engines to run, and the ones left out with the reason."""
    unavailable = {}
    why = peers.llamacpp_available()
    if why:
        unavailable["llamacpp"] = why
    if requested is None:
        return [e for e in ENGINES if e not in unavailable], unavailable
    engines = csv(requested)
    for engine in engines:
        if engine not in ENGINES:
            raise ValueError(f"--engines {engine!r} is not one of {', '.join(ENGINES)}")
    return engines, {e: r for e, r in unavailable.items() if e in engines}


def default_or_given_model(args: argparse.Namespace) -> pathlib.Path:
    """--model, else --random-model (as --gguf-type's GGUF file, if given), else the default model
    (fetched into the model cache on first use)."""
    if args.model and getattr(args, "random_model", None):
        raise ValueError("give --model or --random-model, not both")
    if args.model:
        return pathlib.Path(args.model)
    if getattr(args, "random_model", None):
        if getattr(args, "gguf_type", None):
            from tools.random_gguf import random_gguf

            return random_gguf(args.random_model, args.gguf_type)
        from tools.random_checkpoint import random_checkpoint

        return random_checkpoint(args.random_model)
    from decoders.checkpoints.default_model import default_model_path

    return default_model_path()
