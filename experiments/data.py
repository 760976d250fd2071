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
every run of a sweep sees the same batches. ``record()`` says what was read (the source, files,
bytes and tokens of each split, the vocabulary): a run's ``result.json`` holds it as ``data``.

Token files (``data.tokens``, :func:`load_tokens`, :class:`TokenData`) replace the bytes with
the token ids of a tokenizer, memory-mapped (never read whole), in the two formats LM codebases
exchange: nanoGPT's headerless little-endian ``uint16`` ``.bin`` and llm.c's ``.bin`` (a
header of 256 little-endian int32: magic 20240520 for ``uint16`` tokens or 20240801 for
``uint32``, version, token count; the tokens follow). ``experiments.tokenize`` writes them.
The batches are drawn exactly as from the bytes (the same windows of the same positions).
``token_format="auto"`` reads a file as llm.c's when it holds a whole header whose first int32
is an llm.c magic, else as nanoGPT's. Token ids are checked against ``vocab_size`` in every
batch (lazily: the files are never scanned for that, only to find the vocabulary when neither
``data.vocab_size`` nor a ``tokenizer.json``/``meta.pkl`` beside the file gives it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import sysconfig
import zlib
from pathlib import Path

import numpy as np

__all__ = ["TextData", "TokenData", "load_text", "load_tokens", "load_data", "split_documents",
           "stdlib_files", "Batch", "default_val_path", "LLMC_MAGICS",
           "max_token"]

VOCAB = 256
SEPARATOR = 0

# llm.c's token files: a header of 256 little-endian int32 (magic, version, token count, 0...)
LLMC_HEADER_BYTES = 256 * 4
# magic -> (token dtype, the header versions llm.c writes: 1 for GPT-2's uint16, 7 for
# LLaMA-3's uint32 in dev/data/data_common.py; 2 is accepted too)
LLMC_MAGICS = {20240520: (np.dtype("<u2"), (1,)), 20240801: (np.dtype("<u4"), (2, 7))}
TOKEN_FORMATS = ("auto", "nanogpt", "llmc")


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
            def wanted(f: Path, root: Path = p) -> bool:
                parts = f.relative_to(root).parts
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
    vocab_size: int = VOCAB  # token ids are below it (the model needs at least this many)

    def describe(self) -> str:
        return (f"{self.source}: {self.files[0]} train files ({self.train.size / 1e6:.1f} MB), "
                f"{self.files[1]} validation files ({self.val.size / 1e6:.1f} MB), byte tokens")

    def record(self) -> dict:
        """What a run read, for its records: the source, the files and bytes read, the tokens
        of each split and the vocabulary (a byte per token: each split's tokens are its
        files' bytes and one separator between two files)."""
        splits = {"train": (self.train, self.files[0]), "val": (self.val, self.files[1])}
        return {"kind": "bytes", "source": self.source,
                "files": {k: n for k, (_, n) in splits.items()},
                "bytes": {k: int(x.size) - max(n - 1, 0) for k, (x, n) in splits.items()},
                "tokens": {k: int(x.size) for k, (x, _) in splits.items()},
                "vocab_size": self.vocab_size, "vocab_source": "bytes"}

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


def split_documents(paths=None, *, val_fraction: float = 0.1, suffixes=()
                    ) -> tuple[dict[str, list[tuple[str, bytes]]], str]:
    """The corpus of :func:`load_text` as documents: ``{"train": [(name, bytes), ...], "val":
    [...]}`` (in file order) and a description of the source."""
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
        split["val" if is_val else "train"].append((name, f.read_bytes()))
    if not split["val"] or not split["train"]:  # tiny corpora: hold out the last file
        everything = split["train"] + split["val"]
        if len(everything) < 2:
            raise ValueError(f"need at least 2 files to split into train and validation, got "
                             f"{len(everything)} in {source}")
        split = {"train": everything[:-1], "val": everything[-1:]}
    return split, source


def load_text(paths=None, *, val_fraction: float = 0.1, suffixes=(),
              min_tokens: int = 0) -> TextData:
    """The corpus: ``paths`` (files and folders; a folder contributes every text file under
    it, or those whose suffix is in ``suffixes``, e.g. ``(".txt", ".md")``) or, without
    paths, the standard library's ``.py`` sources."""
    split, source = split_documents(paths, val_fraction=val_fraction, suffixes=suffixes)
    join = lambda docs: np.frombuffer(  # noqa: E731
        bytes([SEPARATOR]).join(b for _, b in docs), np.uint8)
    data = TextData(join(split["train"]), join(split["val"]),
                    (len(split["train"]), len(split["val"])), source)
    if min(data.train.size, data.val.size) <= min_tokens:
        raise ValueError(f"corpus {source} is too small: {data.train.size} train and "
                         f"{data.val.size} validation bytes; sequences need {min_tokens + 1}")
    return data


# ----------------------------------------------------------------------------- token files


@dataclasses.dataclass(kw_only=True)
class TokenData(TextData):
    """Token ids from two memory-mapped files (``train`` and ``val`` are read-only
    ``np.memmap``s; a batch reads only its windows). ``vocab_size`` comes from
    ``data.vocab_size``, a ``tokenizer.json`` or nanoGPT ``meta.pkl`` beside the train file,
    or the largest id in the files + 1 (``vocab_source`` says which); every batch is checked
    against it."""

    paths: tuple[Path, Path]  # the train and validation files
    token_format: str  # "nanogpt" or "llmc"
    vocab_source: str = "data.vocab_size"

    def describe(self) -> str:
        return (f"{self.paths[0]} ({self.token_format}): {self.train.size:,} train and "
                f"{self.val.size:,} validation tokens ({self.paths[1].name}), vocabulary "
                f"{self.vocab_size:,} (from {self.vocab_source})")

    def record(self) -> dict:
        """What a run read: the two files (their absolute paths), their format and sizes in
        bytes (headers included), their tokens and the vocabulary with where it came from."""
        paths = dict(zip(("train", "val"), self.paths, strict=True))
        return {"kind": "tokens", "source": self.source, "token_format": self.token_format,
                "files": {"train": 1, "val": 1},
                "paths": {k: str(p.resolve()) for k, p in paths.items()},
                "bytes": {k: p.stat().st_size for k, p in paths.items()},
                "tokens": {"train": int(self.train.size), "val": int(self.val.size)},
                "vocab_size": self.vocab_size, "vocab_source": self.vocab_source}

    def _windows(self, data, starts, seq_len):
        idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
        tokens = np.asarray(data[idx], dtype=np.int32)
        if tokens.size and tokens.max() >= self.vocab_size:
            row, col = np.argwhere(tokens >= self.vocab_size)[0]
            path = self.paths[0] if data is self.train else self.paths[1]
            raise ValueError(
                f"{path}: token id {tokens[row, col]} (token {int(starts[row]) + col:,} of "
                f"the file) is not below the vocabulary size {self.vocab_size:,} (from "
                f"{self.vocab_source}); set data.vocab_size larger, or 0 for the data's")
        return Batch(tokens, np.ones((len(starts), seq_len), np.float32))


def default_val_path(train: str | Path) -> Path:
    """The validation file beside ``train``, named as llm.c and nanoGPT do: the last
    ``train`` in the name becomes ``val`` (``tiny_shakespeare_train.bin`` ->
    ``tiny_shakespeare_val.bin``, ``train.bin`` -> ``val.bin``)."""
    train = Path(train)
    i = train.name.rfind("train")
    if i < 0:
        raise ValueError(f"data.val_tokens is not set and the name of data.tokens={str(train)!r} "
                         "has no 'train' to derive the validation file's from (*_train.bin -> "
                         "*_val.bin, train.bin -> val.bin): set data.val_tokens=PATH")
    return train.with_name(train.name[:i] + "val" + train.name[i + len("train"):])


def _detect_format(path: Path, size: int) -> str:
    """``auto``: llm.c when the file holds a whole header whose first int32 is an llm.c
    magic, else nanoGPT (headerless uint16)."""
    if size >= LLMC_HEADER_BYTES:
        with open(path, "rb") as f:
            magic = int(np.frombuffer(f.read(4), "<i4")[0])
        if magic in LLMC_MAGICS:
            return "llmc"
    return "nanogpt"


def _llmc_layout(path: Path, size: int) -> tuple[np.dtype, int, int]:
    """``(token dtype, byte offset, token count)`` of an llm.c file, checked against its size."""
    if size < LLMC_HEADER_BYTES:
        raise ValueError(f"{path}: {size:,} bytes is shorter than an llm.c header "
                         f"({LLMC_HEADER_BYTES} bytes): truncated, or not an llm.c file")
    magic, version, count = (int(x) for x in np.fromfile(path, "<i4", 3))
    if magic not in LLMC_MAGICS:
        raise ValueError(
            f"{path}: header magic {magic} is not an llm.c token file's (20240520: uint16 "
            "tokens, 20240801: uint32); data.token_format='nanogpt' reads headerless uint16")
    dtype, versions = LLMC_MAGICS[magic]
    if version not in versions:
        raise ValueError(f"{path}: llm.c header version {version} with magic {magic} is not "
                         f"one this reader knows ({', '.join(map(str, versions))})")
    expected = LLMC_HEADER_BYTES + count * dtype.itemsize
    if count < 0 or size < expected:
        raise ValueError(f"{path}: truncated: its header says {count:,} tokens "
                         f"({expected:,} bytes with the header) but the file has {size:,} bytes")
    if size > expected:
        raise ValueError(f"{path}: {size - expected:,} bytes after the {count:,} tokens its "
                         "header announces: not a whole llm.c file")
    return dtype, LLMC_HEADER_BYTES, count


def _open_tokens(path: Path, token_format: str) -> tuple[np.ndarray, str]:
    """The tokens of one file (a read-only memmap) and its format (``auto`` detected)."""
    if not path.is_file():
        raise FileNotFoundError(
            f"token file {str(path)!r} does not exist (in {str(Path.cwd())!r}, if relative); "
            "`python -m experiments.tokenize` writes one from text")
    if token_format not in TOKEN_FORMATS:
        raise ValueError(f"data.token_format={token_format!r}: use one of {TOKEN_FORMATS}")
    size = path.stat().st_size
    fmt = _detect_format(path, size) if token_format == "auto" else token_format
    if fmt == "llmc":
        dtype, offset, count = _llmc_layout(path, size)
    else:
        if size % 2:
            raise ValueError(f"{path}: {size:,} bytes is an odd length, not a whole number of "
                             "nanoGPT uint16 tokens (truncated?)")
        dtype, offset, count = np.dtype("<u2"), 0, size // 2
    if count == 0:  # (np.memmap cannot map zero bytes)
        return np.zeros(0, dtype), fmt
    return np.memmap(path, dtype, "r", offset, (count,)), fmt


def max_token(tokens: np.ndarray, chunk: int = 1 << 24) -> int:
    """The largest id, read ``chunk`` tokens at a time (-1 for none)."""
    return max((int(tokens[i:i + chunk].max()) for i in range(0, tokens.size, chunk)),
               default=-1)


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles plain data only (nanoGPT's meta.pkl is a dict of ints and strings)."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"meta.pkl refers to {module}.{name}: not plain data")


def _vocab_from_metadata(folder: Path) -> tuple[int, str] | None:
    """The vocabulary size a ``tokenizer.json`` (HF tokenizers: the largest id of its vocab
    and added tokens + 1) or nanoGPT ``meta.pkl`` (its ``vocab_size``) in ``folder`` says."""
    if (path := folder / "tokenizer.json").is_file():
        try:
            t = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: not a tokenizer.json ({e}); set data.vocab_size") from e
        vocab = t.get("model", {}).get("vocab") or {}
        ids = list(vocab.values()) if isinstance(vocab, dict) else [len(vocab) - 1]
        ids += [a["id"] for a in t.get("added_tokens") or ()]
        if ids:
            return max(ids) + 1, str(path)
    if (path := folder / "meta.pkl").is_file():
        try:
            with open(path, "rb") as f:
                meta = _PlainUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, ValueError) as e:
            raise ValueError(f"{path}: not a nanoGPT meta.pkl ({e}); set data.vocab_size") from e
        if isinstance(meta, dict) and isinstance(meta.get("vocab_size"), int):
            return meta["vocab_size"], str(path)
    return None


def _resolve_vocab(vocab_size: int, train: np.ndarray, val: np.ndarray,
                   folder: Path) -> tuple[int, str]:
    if vocab_size:
        if vocab_size < 0:
            raise ValueError(f"data.vocab_size={vocab_size} must be >= 0 (0: from the data)")
        return vocab_size, "data.vocab_size"
    found = _vocab_from_metadata(folder)
    if found:
        return found
    return max(max_token(train), max_token(val)) + 1, "the largest token id + 1"


def load_tokens(path, *, val_path=None, token_format: str = "auto", vocab_size: int = 0,
                seq_len: int = 0) -> TokenData:
    """Memory-map a train token file and its validation file (``val_path``, by default
    :func:`default_val_path`); both must hold more than ``seq_len + 2`` tokens."""
    path = Path(path)
    train, fmt = _open_tokens(path, token_format)
    val_path = Path(val_path) if val_path else default_val_path(path)
    if not val_path.is_file():
        raise FileNotFoundError(f"validation tokens {str(val_path)!r} do not exist (data.tokens="
                                f"{str(path)!r}); write them or set data.val_tokens=PATH")
    val, val_fmt = _open_tokens(val_path, token_format)
    if fmt != val_fmt or train.dtype != val.dtype:
        raise ValueError(f"{path} ({fmt}, {train.dtype}) and {val_path} ({val_fmt}, "
                         f"{val.dtype}) are not in the same format")
    for p, tokens in ((path, train), (val_path, val)):
        if tokens.size <= seq_len + 2:
            raise ValueError(f"{p} holds {tokens.size:,} tokens: too few for one sequence "
                             f"(data.seq_len={seq_len} needs more than {seq_len + 2})")
    vocab, source = _resolve_vocab(vocab_size, train, val, path.parent)
    return TokenData(train, val, (1, 1), str(path), vocab_size=vocab, vocab_source=source,
                     paths=(path, val_path), token_format=fmt)


def load_data(d) -> TextData:
    """The data of a config's ``data`` section: the token files of ``data.tokens`` when it is
    set (:func:`load_tokens`), else the text of ``data.paths`` (:func:`load_text`)."""
    if d.tokens:
        if tuple(d.paths or ()):
            raise ValueError(f"set data.tokens ({d.tokens!r}) or data.paths "
                             f"({tuple(d.paths)!r}), not both")
        return load_tokens(d.tokens, val_path=d.val_tokens or None,
                           token_format=d.token_format or "auto",
                           vocab_size=d.vocab_size or 0, seq_len=d.seq_len or 0)
    stray = [k for k in ("val_tokens", "vocab_size") if d[k]]
    if d.token_format not in (None, "", "auto"):
        stray.append("token_format")
    if stray:
        raise ValueError(f"data.{stray[0]}={d[stray[0]]!r} is set but data.tokens is not "
                         "(the byte data has its own vocabulary, 256)")
    return load_text(list(d.paths or ()) or None, val_fraction=d.val_fraction,
                     suffixes=tuple(d.suffixes))
