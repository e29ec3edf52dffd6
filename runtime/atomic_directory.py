"""A directory written whole or not at all, and a list of its files to check it by.

    with replaced_directory(target) as staging:     # a new directory beside target
        write everything into staging
        (staging / "files.json").write_text(json.dumps(file_list(staging)))   # last
    # staging is renamed to target; an old target is moved aside first, then removed

A kill at any moment leaves the old target, or (between the two renames, a moment) no
target and the old one beside it under `.NAME.replaced-*` (interrupted_replacements()
finds it); never a mix. Staging directories of killed writers (`.NAME.saving-PID-*`) are
removed by the next writer once their process is gone.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import shutil
import tempfile
from typing import Callable, Iterator


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:         # someone else's process
        return True
    return True


def _remove_stale_staging(target: pathlib.Path) -> None:
    """Staging directories beside target whose writer died (a kill mid-save)."""
    for path in target.parent.glob(f".{target.name}.saving-*"):
        pid = path.name[len(f".{target.name}.saving-"):].split("-", 1)[0]
        if pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def interrupted_replacements(target: str | os.PathLike) -> list[pathlib.Path]:
    """The old directories a replacement of target moved aside and did not finish removing."""
    target = pathlib.Path(target)
    return sorted(target.parent.glob(f".{target.name}.replaced-*"))


@contextlib.contextmanager
def replaced_directory(target: str | os.PathLike) -> Iterator[pathlib.Path]:
    """A new, empty directory beside `target`; when the block ends without an error it
    becomes `target` (whatever was there is removed), otherwise it is removed."""
    target = pathlib.Path(target).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(target)
    staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.saving-{os.getpid()}-",
                                            dir=target.parent))
    try:
        yield staging
        _fsync_tree(staging)
        if target.exists():
            aside = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.replaced-", dir=target.parent))
            os.replace(target, aside)       # onto the empty directory mkdtemp made
            os.replace(staging, target)
            shutil.rmtree(aside)
        else:
            os.replace(staging, target)
        _fsync_directory(target.parent)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _fsync_directory(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: pathlib.Path) -> None:
    """Every file and directory under root on disk before the rename publishes them (a power
    cut after the rename must not leave a named directory of empty files)."""
    for folder, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_directory(pathlib.Path(folder))


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_list(directory: str | os.PathLike, hashed: Callable[[str], bool] = lambda name: True) -> dict:
    """{relative path: {"bytes": size, "sha256": digest where hashed(path)}} of every file under
    directory, to write last and check with damaged_files()."""
    directory = pathlib.Path(directory)
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        name = path.relative_to(directory).as_posix()
        files[name] = {"bytes": path.stat().st_size}
        if hashed(name):
            files[name]["sha256"] = _sha256(path)
    return files


def damaged_files(directory: str | os.PathLike, files: dict) -> list[str]:
    """What differs from file_list()'s record, one short phrase per file (empty: all whole)."""
    directory = pathlib.Path(directory)
    problems = []
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != expected["bytes"]:
            problems.append(f"{name} has {path.stat().st_size} bytes, not {expected['bytes']}")
        elif "sha256" in expected and _sha256(path) != expected["sha256"]:
            problems.append(f"{name} is not the file saved")
    return problems
