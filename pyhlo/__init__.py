"""PyHLO: a Python DSL that writes XLA HloModuleProto programs."""
from pyhlo.scribe import HloValue, Scribe, compile_py_func
from pyhlo.shape_inference import HloShapeError

__all__ = ["compile_py_func", "Scribe", "HloValue", "HloShapeError"]
