"""The directory model.save() writes, as load() checks it:

    DIR/pyhlo_model.json          the settings, and every file's size (the programs' sha256), written last
    DIR/programs/NAME.pb|.exe     each compiled program (programs/manifest.json: their HLO hashes)
    DIR/weights/rank{r}.safetensors   presharded weights, with sharded_weights=True

save() replaces the whole directory (runtime/atomic_directory.py), so it refuses one holding
anything else; load() names a directory that is missing, partial or mixed and says to save again.
"""
from __future__ import annotations

import json
import pathlib

from runtime.atomic_directory import damaged_files, file_list, interrupted_replacements

SAVED_DESCRIPTION = "pyhlo_model.json"
# What save() writes: a directory holding anything else is not replaced by it.
_SAVED_NAMES = {SAVED_DESCRIPTION, "programs", "weights"}


def check_replaceable(directory: pathlib.Path) -> None:
    """save() replaces the whole directory: refuse one that holds files save() did not write."""
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"cannot save into {directory}: it is a file")
    foreign = sorted(p.name for p in directory.iterdir() if p.name not in _SAVED_NAMES) \
        if directory.is_dir() else []
    if foreign:
        raise ValueError(f"cannot save into {directory}: save() replaces the whole directory, and it holds "
                         f"{', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}, which save() "
                         "did not write; choose a new or empty directory")


def read_description(directory: pathlib.Path) -> dict:
    """The description save() wrote in directory, its files checked; a ValueError naming the
    directory (and saying to save again) when it is missing, partial or mixed."""
    again = "save the model again (model.save())"
    if not directory.is_dir():
        aside = interrupted_replacements(directory)
        hint = (f"; a save into it was interrupted before it finished: the earlier save is in {aside[-1]}"
                if aside else "")
        raise ValueError(f"{directory} does not exist{hint}")
    path = directory / SAVED_DESCRIPTION
    if not path.exists():
        raise ValueError(f"{directory} has no {SAVED_DESCRIPTION}: it was not written by model.save(), or "
                         f"a save into it did not finish; {again}")
    try:
        saved = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is damaged ({err}); {again}") from None
    problems = damaged_files(directory, saved.get("files", {}))
    if problems:
        more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise ValueError(f"{directory} is not what model.save() wrote: {'; '.join(problems[:3])}{more}; "
                         f"{again}")
    return saved


def write_description(directory: pathlib.Path, description: dict, list_files: bool = True) -> None:
    """pyhlo_model.json, last: with list_files, every file written before it, sized, the
    programs hashed (a wrong one fails inside XLA, naming nothing; hashing the weights would
    read every byte again at each load)."""
    if list_files:
        description = {**description,
                       "files": file_list(directory, hashed=lambda name: name.startswith("programs/"))}
    (directory / SAVED_DESCRIPTION).write_text(json.dumps(description, indent=2))
