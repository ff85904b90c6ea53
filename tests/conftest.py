"""Shared fixtures: tiny random checkpoints written with transformers' save_pretrained, once per session."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

import tforce
from tforce.paths import MODELS
from tforce.model.synthetic import make_checkpoint

# name -> make_checkpoint overrides. All share the 259-token byte vocabulary so any pair can draft.
TINY = {
    "mha": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa": dict(num_attention_heads=4, num_key_value_heads=2),
    "yarn": dict(num_key_value_heads=2, max_position_embeddings=4096,
                 rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}),
    "llama3": dict(num_key_value_heads=1, rope_theta=500000.0,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 512}),
    "draft": dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
                  num_hidden_layers=1),
}


# Runs without --model use the small demo pair (fast), not SmolLM2: set for the whole session, fixtures of
# every scope included (tests/model/test_default_model.py removes it to check the choice itself).
os.environ.setdefault("TFORCE_DEMO_MODELS", str(MODELS))

# A fixed thread count for the suite's command-line runs (tforce/threads.py would follow the machine's
# load, which the other test worker changes): results and timings do not depend on the neighbour.
os.environ.setdefault("TFORCE_THREADS", "1")

# --method auto's calibrations (tforce/auto/calibration.py) and GGUF conversions go to a folder of this session
# (command-line runs in subprocesses included), not the user's cache: a calibration left by an earlier
# session would decide what a test's run measures.
if "TFORCE_CACHE" not in os.environ:
    os.environ["TFORCE_CACHE"] = tempfile.mkdtemp(prefix="tforce-test-cache-")
    atexit.register(shutil.rmtree, os.environ["TFORCE_CACHE"], True)

# The test models are tiny: one thread is faster than two fighting over a 2-core machine.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def one_thread_again():
    """A CLI run inside a test chooses threads for the process (tforce/threads.py); the next test starts
    from the suite's one thread, ungoverned."""
    yield
    from tforce import threads

    threads._governor = None
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """Folder with one subfolder per TINY entry, each a Hugging Face checkpoint."""
    root = tmp_path_factory.mktemp("tiny")
    for i, (name, overrides) in enumerate(TINY.items()):
        make_checkpoint(root / name, seed=i, **overrides)
    return root


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    """name -> tforce.LoadedModel (float32, CPU)."""
    return {name: tforce.load_model(str(tiny_dir / name)) for name in TINY}


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """(target, draft) over the exact-distribution tests' tiny vocabulary (exactness_helpers.vocab_pair)."""
    from exactness_helpers import vocab_pair

    return vocab_pair(tmp_path_factory.mktemp("v6"))
