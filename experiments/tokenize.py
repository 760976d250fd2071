"""Turn text into llm.c token files with a byte-level BPE tokenizer trained here.

    python -m experiments.tokenize --vocab-size 4096      # the standard-library corpus
    python -m experiments.tokenize --out my-tokens --vocab-size 8192 my/texts --suffixes .md
    python -m experiments.train --workdir results/runs/bpe data.tokens=OUT/train.bin

The corpus and its train/validation split are those of ``experiments.data`` (the standard
library's ``.py`` sources by default, or the files and folders named, split by a stable hash of
each file's path). A byte-level BPE (HF ``tokenizers``, GPT-2's pre-tokenizer; nothing is
downloaded) is trained on the train split only, with one special token, ``<|endoftext|>``
(id 0), which starts every document (as in llm.c). It writes to ``--out``:

* ``train.bin``, ``val.bin``: llm.c token files (a header of 256 little-endian int32: magic
  20240520, version 1, token count; then ``uint16`` tokens; magic 20240801, version 7 and
  ``uint32`` tokens for a vocabulary over 65,536);
* ``tokenizer.json``: the tokenizer (``tokenizers.Tokenizer.from_file``); training reads its
  vocabulary size from it;
* ``manifest.json``: what they were made from (a hash of every document, the vocabulary size,
  the split, the ``tokenizers`` version). A rerun with the same inputs does nothing.

Every file is written to a temporary name and renamed into place, the manifest last, so an
interrupted run leaves no half-written file that a rerun would trust.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

from experiments.commands import command
from experiments.data import LLMC_HEADER_BYTES, split_documents
from fp4lab.files import atomic

__all__ = ["tokenize", "train_bpe", "write_llmc", "corpus_key", "main", "EOT"]

EOT = "<|endoftext|>"
FORMAT_VERSION = 1  # of what this module writes: part of the cache key
OUTPUTS = ("train.bin", "val.bin", "tokenizer.json")


def _tokenizers():
    try:
        import tokenizers
    except ImportError as e:  # an extra: pip install 'fp4lab[experiments]'
        raise ImportError("experiments.tokenize needs HF tokenizers: pip install "
                          "'tokenizers>=0.20' (in the experiments extra)") from e
    return tokenizers


def corpus_key(split: dict, vocab_size: int, val_fraction: float) -> str:
    """A hash of everything the outputs depend on: the settings and every document (its split,
    name and content)."""
    h = hashlib.sha256(json.dumps({
        "format": FORMAT_VERSION, "vocab_size": vocab_size, "val_fraction": val_fraction,
        "tokenizers": _tokenizers().__version__}, sort_keys=True).encode())
    for part in ("train", "val"):
        for name, data in split[part]:
            h.update(f"{part}\0{name}\0{hashlib.sha256(data).hexdigest()}\n".encode())
    return h.hexdigest()


def _text(doc: bytes) -> str:
    return doc.decode("utf-8", errors="replace")  # (a non-UTF-8 byte becomes U+FFFD)


def train_bpe(docs: list[bytes], vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` of at most ``vocab_size`` tokens (the 256
    bytes, ``<|endoftext|>`` and merges) trained on ``docs``."""
    tk = _tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((_text(d) for d in docs), trainer, length=len(docs))
    return tok


def _encoded(tok, docs: list[bytes], dtype, batch: int = 256):
    """The token ids of ``docs``, each document preceded by ``<|endoftext|>``, in chunks."""
    eot = tok.token_to_id(EOT)
    for i in range(0, len(docs), batch):
        encodings = tok.encode_batch([_text(d) for d in docs[i:i + batch]])
        yield np.concatenate([np.array([eot] + e.ids, dtype) for e in encodings])


def _replace_atomically(path: Path, write) -> None:
    """``write(file)`` into a temporary file beside ``path`` that then replaces it."""
    with atomic(path) as tmp, open(tmp, "wb") as f:
        write(f)


def write_llmc(path: Path, chunks, vocab_size: int) -> int:
    """Write the token arrays ``chunks`` as one llm.c file (streamed; atomically); returns
    the token count."""
    wide = vocab_size > 1 << 16
    magic, version, dtype = (20240801, 7, "<u4") if wide else (20240520, 1, "<u2")
    count = 0

    def write(f):
        nonlocal count
        f.write(bytes(LLMC_HEADER_BYTES))  # the header, filled in below
        for chunk in chunks:
            f.write(np.asarray(chunk, dtype).tobytes())
            count += len(chunk)
        if count >= 1 << 31:
            raise ValueError(f"{path}: {count:,} tokens do not fit llm.c's int32 count")
        header = np.zeros(LLMC_HEADER_BYTES // 4, "<i4")
        header[:3] = magic, version, count
        f.seek(0)
        f.write(header.tobytes())

    _replace_atomically(path, write)
    return count


def _up_to_date(out: Path, key: str) -> dict | None:
    """The manifest of ``out`` if it was made from ``key`` and its files are all there."""
    try:
        manifest = json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("key") != key:
        return None
    sizes = manifest.get("sizes", {})
    if all((out / n).is_file() and (out / n).stat().st_size == sizes.get(n) for n in OUTPUTS):
        return manifest
    return None


def tokenize(paths=None, *, out, vocab_size: int = 4096, val_fraction: float = 0.1,
             suffixes=(), force: bool = False, log=print) -> dict:
    """Tokenize the corpus of ``experiments.data`` (``paths`` or the standard library) into
    ``out``; returns the manifest, with ``"written"`` False when ``out`` was up to date."""
    if not 257 <= vocab_size < 1 << 31:
        raise ValueError(f"--vocab-size {vocab_size}: need at least 257 (256 bytes and "
                         "<|endoftext|>) and below 2**31")
    out = Path(out)
    split, source = split_documents(paths, val_fraction=val_fraction, suffixes=suffixes)
    key = corpus_key(split, vocab_size, val_fraction)
    if not force and (manifest := _up_to_date(out, key)):
        log(f"{out}: up to date ({source}, vocabulary {manifest['vocab_size']:,})")
        return {**manifest, "written": False}
    out.mkdir(parents=True, exist_ok=True)
    log(f"training a byte-level BPE of {vocab_size:,} tokens on {len(split['train']):,} "
        f"files of {source}")
    tok = train_bpe([d for _, d in split["train"]], vocab_size)
    vocab = tok.get_vocab_size()
    dtype = "<u4" if vocab > 1 << 16 else "<u2"
    counts = {}
    for part in ("train", "val"):
        docs = [d for _, d in split[part]]
        counts[part] = write_llmc(out / f"{part}.bin", _encoded(tok, docs, dtype), vocab)
    _replace_atomically(out / "tokenizer.json", lambda f: f.write(tok.to_str().encode()))
    manifest = {"key": key, "source": source, "vocab_size": vocab,
                "requested_vocab_size": vocab_size, "val_fraction": val_fraction,
                "files": {p: len(split[p]) for p in split}, "tokens": counts,
                "sizes": {n: (out / n).stat().st_size for n in OUTPUTS}}
    _replace_atomically(out / "manifest.json",
                        lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    log(f"{out}: {counts['train']:,} train and {counts['val']:,} validation tokens, "
        f"vocabulary {vocab:,}; train with data.tokens={out / 'train.bin'}")
    return {**manifest, "written": True}


@command
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.tokenize",
        description="Train a byte-level BPE on a text corpus (by default the Python standard "
                    "library's sources) and write llm.c token files (train.bin, val.bin), "
                    "tokenizer.json and manifest.json; a rerun with the same inputs does "
                    "nothing.")
    ap.add_argument("paths", nargs="*", help="files and folders of text (default: the "
                    "standard library's .py files), split as experiments.data splits them")
    ap.add_argument("--out", help="output folder (default: results/tokens/stdlib-bpe<V>, or "
                    "results/tokens/text-bpe<V> with paths)")
    ap.add_argument("--vocab-size", type=int, default=4096,
                    help="BPE vocabulary size, special token included (default 4096)")
    ap.add_argument("--val-fraction", type=float, default=0.1,
                    help="share of files held out for validation (default 0.1)")
    ap.add_argument("--suffixes", nargs="*", default=(),
                    help="in folders, only files with these suffixes (e.g. .txt .md)")
    ap.add_argument("--force", action="store_true", help="rewrite even if up to date")
    args = ap.parse_args(argv)
    out = args.out or (f"results/tokens/{'text' if args.paths else 'stdlib'}"
                       f"-bpe{args.vocab_size}")
    try:
        tokenize(args.paths or None, out=out, vocab_size=args.vocab_size,
                 val_fraction=args.val_fraction, suffixes=tuple(args.suffixes),
                 force=args.force, log=lambda m: print(m, file=sys.stderr))
    except ImportError as e:  # the tokenizers extra (other mistakes: experiments.commands)
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
