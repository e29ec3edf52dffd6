"""A persistent compile cache: serialized executables on disk, keyed by what built them.

    cache = CompileCache()                       # dir: argument, env PYHLO_CACHE_DIR, ~/.cache/pyhlo/compile
    exe, hit = cache.get_or_compile(backend, hlo_bytes)

The key is a sha256 over the HLO bytes, the backend's cache_key_parts() (backend,
platform, compiler version, flags) and the replica count. An entry is a header (magic,
format version, its own key, payload length, payload sha256) and the serialized
executable; an entry whose key is not the one it is stored under (a file copied or
renamed over another) is another program's executable, so it is rebuilt, never run. Entries
are written to a temporary file in the cache directory and renamed into place, so
readers and concurrent writers see a whole entry or none. A damaged entry is reported,
deleted and rebuilt. PYHLO_CACHE=0 turns the cache off.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import tempfile
import time
import warnings
from typing import Any

MAGIC = b"PYHLOEXE"
FORMAT_VERSION = 2
_HEADER = struct.Struct("<8sI32sQ32s")  # magic, format version, key (sha256), payload length, payload sha256
SUFFIX = ".exe"


class CorruptEntry(Exception):
    pass


@dataclasses.dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    rebuilt: int = 0  # damaged entries replaced
    compile_seconds: float = 0.0
    load_seconds: float = 0.0


def default_cache_dir() -> str:
    return os.environ.get("PYHLO_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pyhlo",
                                                             "compile")


def cache_enabled() -> bool:
    return os.environ.get("PYHLO_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_key(backend: Any, hlo_bytes: bytes, num_replicas: int = 1) -> str:
    """sha256 hex of the HLO bytes, the backend's key parts and the replica count."""
    parts = dict(backend.cache_key_parts(), num_replicas=str(num_replicas))
    digest = hashlib.sha256()
    digest.update(json.dumps(parts, sort_keys=True).encode())
    digest.update(b"\0")
    digest.update(hlo_bytes)
    return digest.hexdigest()


def pack_entry(payload: bytes, key: str) -> bytes:
    """An entry holding `payload`, the executable of cache key `key` (hex)."""
    return _HEADER.pack(MAGIC, FORMAT_VERSION, bytes.fromhex(key), len(payload),
                        hashlib.sha256(payload).digest()) + payload


def unpack_entry(data: bytes, key: str) -> bytes:
    """The payload of an entry stored under cache key `key`; CorruptEntry if the header, the
    checksum or the entry's own key does not match."""
    if len(data) < _HEADER.size:
        raise CorruptEntry(f"{len(data)} bytes is shorter than the {_HEADER.size}-byte header")
    magic, version, own_key, length, checksum = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CorruptEntry("bad magic")
    if version != FORMAT_VERSION:
        raise CorruptEntry(f"format version {version}, expected {FORMAT_VERSION}")
    if own_key.hex() != key:
        raise CorruptEntry(f"it holds the executable of key {own_key.hex()[:16]}..., not of the key "
                           f"it is stored under")
    payload = data[_HEADER.size:]
    if len(payload) != length:
        raise CorruptEntry(f"payload is {len(payload)} bytes, header says {length}")
    if hashlib.sha256(payload).digest() != checksum:
        raise CorruptEntry("payload checksum mismatch")
    return payload


def write_atomically(path: str, data: bytes) -> None:
    """Write data to path so that readers see the old file, or all of the new one."""
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


class CompileCache:
    """Compiled executables on disk, shared by processes using the same directory."""

    def __init__(self, dir: str | None = None, enabled: bool | None = None):
        self.dir = os.path.abspath(os.path.expanduser(dir or default_cache_dir()))
        self.enabled = cache_enabled() if enabled is None else enabled
        self.stats = CacheStats()

    @property
    def hits(self) -> int:
        return self.stats.hits

    @property
    def misses(self) -> int:
        return self.stats.misses

    @property
    def compile_seconds(self) -> float:
        return self.stats.compile_seconds

    def path_of(self, key: str) -> str:
        return os.path.join(self.dir, key + SUFFIX)

    def holds(self, backend: Any, hlo_bytes: bytes, num_replicas: int = 1) -> bool:
        """Whether get_or_compile() would find an entry (to say ahead of time that a compile is coming)."""
        return self.enabled and os.path.exists(self.path_of(cache_key(backend, hlo_bytes, num_replicas)))

    def get_or_compile(self, backend: Any, hlo_bytes: bytes, num_replicas: int = 1) -> tuple[Any, bool]:
        """The executable of hlo_bytes on backend, and whether it came from the cache."""
        if not self.enabled:
            return self._compile(backend, hlo_bytes, num_replicas), False
        key = cache_key(backend, hlo_bytes, num_replicas)
        path = self.path_of(key)
        executable = self._load(backend, hlo_bytes, num_replicas, key)
        if executable is not None:
            self.stats.hits += 1
            return executable, True
        executable = self._compile(backend, hlo_bytes, num_replicas)
        os.makedirs(self.dir, exist_ok=True)
        write_atomically(path, pack_entry(executable.serialize(), key))
        return executable, False

    def _compile(self, backend: Any, hlo_bytes: bytes, num_replicas: int) -> Any:
        self.stats.misses += 1
        start = time.perf_counter()
        executable = backend.compile(hlo_bytes, num_replicas=num_replicas)
        self.stats.compile_seconds += time.perf_counter() - start
        return executable

    def _load(self, backend: Any, hlo_bytes: bytes, num_replicas: int, key: str) -> Any | None:
        start = time.perf_counter()
        path = self.path_of(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        try:
            payload = unpack_entry(data, key)
            executable = backend.deserialize(payload, hlo_bytes, num_replicas=num_replicas)
        except Exception as err:  # a damaged entry, whatever the failure: rebuild it
            warnings.warn(f"compile cache entry {path} is damaged ({err}); deleting and recompiling",
                          RuntimeWarning, stacklevel=3)
            self.stats.rebuilt += 1
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            return None
        self.stats.load_seconds += time.perf_counter() - start
        return executable

    def clear(self) -> int:
        """Delete every entry; returns how many were deleted."""
        if not os.path.isdir(self.dir):
            return 0
        removed = 0
        for name in os.listdir(self.dir):
            if name.endswith(SUFFIX):
                os.unlink(os.path.join(self.dir, name))
                removed += 1
        return removed

    def __repr__(self) -> str:
        state = "" if self.enabled else " (disabled)"
        return f"<CompileCache {self.dir}{state} hits={self.stats.hits} misses={self.stats.misses}>"
