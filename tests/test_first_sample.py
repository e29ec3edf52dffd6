"""to_neuron() leaves nothing for the first sample() to do lazily (for a server, the first
request's time to first token): no program built on first use, no module imported."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from child_env import python_path

from decoders import LlamaForSampling

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPT = [[3, 1, 4, 1, 5]]


@pytest.fixture(scope="module")
def path(tiny_llama):
    return tiny_llama("mha", "safetensors")[1]


def test_first_samples_build_no_program(path):
    model = LlamaForSampling.from_pretrained(path, batch_size=1, n_positions=128, amp="f32").to_neuron()
    built = set(model.programs.compiled)
    model.sample(PROMPT, sequence_length=12, seed=0)             # sample()'s default top_k
    model.sample(PROMPT, sequence_length=12, top_k=1)            # greedy
    model.sample(PROMPT, sequence_length=12, top_k=20, top_p=0.9, temperature=0.7, seed=1)
    assert set(model.programs.compiled) == built


# In a fresh process: this one imported torch long ago.
FIRST_SAMPLE = """
import json, sys
from decoders import LlamaForSampling
model = LlamaForSampling.from_pretrained(sys.argv[1], batch_size=1, n_positions=128, amp="f32")
model.to_neuron()
before = set(sys.modules)
model.sample({prompt}, sequence_length=12, seed=0)
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def test_first_sample_imports_nothing(path):
    env = dict(os.environ, PYTHONPATH=python_path(REPO_ROOT))
    done = subprocess.run([sys.executable, "-c", FIRST_SAMPLE.format(prompt=PROMPT), str(path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
