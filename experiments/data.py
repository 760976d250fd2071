"""Byte-level text data: by default the source files of the running Python's standard library.

The corpus is every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]`` (site-packages and
dist-packages excluded), read in sorted path order, so every machine with the same Python has
the same corpus without a download (CPython 3.12.1: 2,231 files, about 37.7 MB; other versions
differ slightly). Any files or folders a user names replace it: every text file under a
folder (no NUL byte in it; hidden files and ``__pycache__`` left out), or only those with the
suffixes in ``data.suffixes``.

Files are split into train and validation by a stable hash of their relative path (so adding a
file never moves another between splits); each split is one ``uint8`` array of the files'
bytes joined by a separator byte (0, which never occurs in source text). Tokens are bytes
(vocabulary 256).

Batches are a pure function of ``(seed, step)``: training resumes bit-exactly at any step, and
every run of a sweep sees the same batches.
"""

from __future__ import annotations

import dataclasses
import os
import sysconfig
import zlib
from pathlib import Path

import numpy as np

__all__ = ["TextData", "load_text", "stdlib_files", "Batch"]

VOCAB = 256
SEPARATOR = 0


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))


def is_text(path: Path) -> bool:
    """A file is text when its first 8 KiB hold no NUL byte (NUL separates the documents)."""
    with open(path, "rb") as f:
        return b"\0" not in f.read(8192)


def _expand(paths, suffixes) -> list[tuple[Path, str]]:
    """``(file, name-for-the-split-hash)`` for every file under ``paths``, sorted: in folders,
    the text files (:func:`is_text`) whose suffix is in ``suffixes`` (any suffix if empty),
    leaving out hidden files and folders and ``__pycache__``."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            def wanted(f: Path) -> bool:
                parts = f.relative_to(p).parts
                return (f.is_file() and not any(x.startswith(".") or x == "__pycache__"
                                                for x in parts)
                        and (not suffixes or f.suffix in suffixes) and is_text(f))

            files = sorted(f for f in p.rglob("*") if wanted(f))
            out += [(f, str(f.relative_to(p))) for f in files]
        elif p.is_file():
            out.append((p, p.name))
        else:
            raise FileNotFoundError(f"data path {str(p)!r} does not exist")
    return out


@dataclasses.dataclass(frozen=True)
class Batch:
    tokens: np.ndarray  # (B, L + 1) int32: inputs are [:, :-1], targets [:, 1:]
    weights: np.ndarray  # (B, L) float32 loss weights


@dataclasses.dataclass
class TextData:
    train: np.ndarray  # uint8
    val: np.ndarray
    files: tuple[int, int]  # train / validation file counts
    source: str

    def describe(self) -> str:
        return (f"{self.source}: {self.files[0]} train files ({self.train.size / 1e6:.1f} MB), "
                f"{self.files[1]} validation files ({self.val.size / 1e6:.1f} MB), byte tokens")

    def _windows(self, data, starts, seq_len):
        idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
        tokens = data[idx].astype(np.int32)
        return Batch(tokens, np.ones((len(starts), seq_len), np.float32))

    def batch(self, seed: int, step: int, batch_size: int, seq_len: int) -> Batch:
        """The training batch of ``step``: random windows, a pure function of (seed, step)."""
        rng = np.random.default_rng([seed, step])
        return self._windows(self.train,
                             rng.integers(0, self.train.size - seq_len - 1, batch_size), seq_len)

    def val_batches(self, n: int, batch_size: int, seq_len: int) -> list[Batch]:
        """``n`` fixed validation batches, evenly spaced through the validation split."""
        total = n * batch_size
        starts = np.linspace(0, self.val.size - seq_len - 2, total).astype(np.int64)
        return [self._windows(self.val, starts[i * batch_size:(i + 1) * batch_size], seq_len)
                for i in range(n)]


def load_text(paths=None, *, val_fraction: float = 0.1, suffixes=(),
              min_tokens: int = 0) -> TextData:
    """The corpus: ``paths`` (files and folders; a folder contributes every text file under
    it, or those whose suffix is in ``suffixes``, e.g. ``(".txt", ".md")``) or, without
    paths, the standard library's ``.py`` sources."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1)")
    if paths:
        files, source = _expand(paths, tuple(suffixes)), ", ".join(map(str, paths))
    else:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [(f, str(f.relative_to(root))) for f in stdlib_files()]
        source = f"Python {'.'.join(map(str, os.sys.version_info[:3]))} standard library"
    if not files:
        raise FileNotFoundError(f"no text files found in {paths!r} (suffixes {suffixes})")
    split = {"train": [], "val": []}
    for f, name in files:
        is_val = zlib.crc32(name.encode()) % 10_000 < val_fraction * 10_000
        split["val" if is_val else "train"].append(f.read_bytes())
    if not split["val"] or not split["train"]:  # tiny corpora: hold out the last file
        everything = split["train"] + split["val"]
        if len(everything) < 2:
            raise ValueError(f"need at least 2 files to split into train and validation, got "
                             f"{len(everything)} in {source}")
        split = {"train": everything[:-1], "val": everything[-1:]}
    join = lambda parts: np.frombuffer(bytes([SEPARATOR]).join(parts), np.uint8)  # noqa: E731
    data = TextData(join(split["train"]), join(split["val"]),
                    (len(split["train"]), len(split["val"])), source)
    if min(data.train.size, data.val.size) <= min_tokens:
        raise ValueError(f"corpus {source} is too small: {data.train.size} train and "
                         f"{data.val.size} validation bytes; sequences need {min_tokens + 1}")
    return data
