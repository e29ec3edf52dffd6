"""The import path of a Python child process that a test starts."""
from __future__ import annotations

import os


def python_path(*folders: object) -> str:
    """PYTHONPATH for a child: `folders` first, then this process's own PYTHONPATH, so a child
    imports the packages the suite imports even where they were put on the path by hand."""
    inherited = os.environ.get("PYTHONPATH")
    return os.pathsep.join([str(f) for f in folders] + ([inherited] if inherited else []))
