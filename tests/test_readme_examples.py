"""Every python code block of README.md runs as written, on the default model, in a fresh
interpreter (the OpenAI client's block against `pyhlo serve` started for it on port 8000).

Slow: each block builds SmolLM2-135M-Instruct's programs (a minute or more each on 2 cores
with an empty compile cache); not part of the quick subset.
"""
from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from child_env import python_path

REPO = Path(__file__).resolve().parent.parent
SERVER_PORT = 8000                      # the port the README's client block names

pytestmark = pytest.mark.slow


def python_blocks() -> list[tuple[int, str]]:
    """(line number, code) of each ```python block of README.md."""
    text = (REPO / "README.md").read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)]


BLOCKS = python_blocks()


def environment() -> dict:
    return dict(os.environ, PYTHONPATH=python_path(REPO))


@contextlib.contextmanager
def default_model_server():
    """`pyhlo serve` of the default model on 127.0.0.1:8000 until the block has run."""
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", SERVER_PORT)) == 0:
            pytest.skip(f"port {SERVER_PORT}, which the README's client block names, is taken")
    server = subprocess.Popen([sys.executable, "-m", "tools.cli", "serve", "--port", str(SERVER_PORT),
                               "--batch-size", "1", "--n-positions", "256"], cwd=REPO, env=environment(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                raise AssertionError(f"pyhlo serve exited: {server.stderr.read()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{SERVER_PORT}/health", timeout=5):
                    break
            except OSError:
                assert time.monotonic() < deadline, "pyhlo serve did not answer within 600 s"
                time.sleep(1)
        yield
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 5


@pytest.mark.parametrize("code", [code for _, code in BLOCKS], ids=[f"line{line}" for line, _ in BLOCKS])
def test_readme_python_block_runs_as_written(code, tmp_path):
    serving = "OpenAI(base_url" in code
    with default_model_server() if serving else contextlib.nullcontext():
        done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=environment(),
                              capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
