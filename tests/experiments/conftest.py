"""Shared fixtures for the experiment tests: a small real-text corpus (the stdlib's json
package) and the tiny config."""

import json
from pathlib import Path

import pytest
from environments import COMPILE_CACHE

from experiments.configs import load_config
from experiments.data import load_text


@pytest.fixture(scope="session")
def corpus_dir():
    return Path(json.__file__).parent


@pytest.fixture(scope="session")
def text(corpus_dir):
    return load_text([corpus_dir], val_fraction=0.3)


@pytest.fixture
def tiny():
    c = load_config("tiny")
    c.compile_cache = COMPILE_CACHE
    return c


@pytest.fixture(scope="session")
def train_tiny(tmp_path_factory, corpus_dir):
    """``train_tiny(policy, **model_keys) -> (config, run folder)``: the tiny config on the
    corpus, trained 8 steps (one checkpoint), for the tests that analyse a trained run. No
    probes: none of them reads a probe record, and the probe step is a program of its own
    to compile."""
    from experiments.train import train

    def run(policy: str, **model_keys):
        c = load_config("tiny")
        c.compile_cache = COMPILE_CACHE
        c.data.paths = (str(corpus_dir),)
        c.precision.policy, c.train.steps, c.train.ckpt_every = policy, 8, 8
        c.probes.every = 0
        for key, value in model_keys.items():
            c.model[key] = value
        folder = tmp_path_factory.mktemp("trained") / "run"
        train(c, folder, progress=False)
        return c, folder

    return run


@pytest.fixture(scope="session")
def token_dirs(tmp_path_factory, corpus_dir):
    """The json package tokenized (BPE of 300: ids above the byte vocabulary) in llm.c
    format, and the same tokens as nanoGPT files (raw uint16, with the tokenizer beside
    them)."""
    import shutil

    import numpy as np

    from experiments.tokenize import tokenize

    root = tmp_path_factory.mktemp("tokens")
    tokenize([corpus_dir], out=root / "llmc", vocab_size=300, val_fraction=0.3,
             log=lambda s: None)
    (root / "nanogpt").mkdir()
    for part in ("train", "val"):
        ids = np.fromfile(root / "llmc" / f"{part}.bin", "<u2", offset=1024)
        ids.astype("<u2").tofile(root / "nanogpt" / f"{part}.bin")
    shutil.copy(root / "llmc" / "tokenizer.json", root / "nanogpt")
    return root
