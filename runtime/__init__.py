"""The runtime: compile HloModuleProto bytes with a backend, cache executables, run them.

Only runtime/pjrt.py imports private jaxlib APIs; importing this package does not import jax.
"""
from runtime.backend import Backend, Executable, ProgramInfo, XlaBackend
from runtime.compile_cache import CompileCache
from runtime.select import get_backend

__all__ = ["Backend", "CompileCache", "Executable", "ProgramInfo", "XlaBackend", "get_backend"]
