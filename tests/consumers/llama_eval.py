"""Evaluate token windows with llama.cpp itself (llama-cpp-python, run by the consumers'
Python, scripts/consumer-venv; never by fp4lab's):

    python tests/consumers/llama_eval.py TOKENS.npy MODEL.gguf OUT.npz [MODEL.gguf OUT.npz ...]
        [--text TEXT]

Each model is loaded in turn in this one process. ``TOKENS.npy`` holds int ``[windows,
length + 1]`` token ids. Each window is one sequence: ``llama_cpp.Llama`` (CPU,
``logits_all=True``, a context of the window's length, the KV cache in F32 so that K and V
are not rounded to F16, flash attention off, one batch per window; the weights in their
GGUF types, loaded by ``experiments.serve.load``: :func:`_load`) starts from an empty state
(attention cache and Mamba-2 state cleared) and evaluates the first ``length`` ids. Each
``OUT.npz`` holds ``logits`` (float32 ``[windows, length, vocab]``: the logits at every
position), ``loss`` (the mean next-token negative log-likelihood of the last ``length`` ids,
in float64 from the float32 logits), ``n_vocab`` and, with ``--text``, ``tokens``:
llama.cpp's tokenization of that text with the file's vocabulary (no BOS), and
``detokenized``, those ids turned back into bytes.
"""

import argparse
import runpy
import sys
from pathlib import Path

import numpy as np

# experiments/serve.py run as a file: importing the experiments package needs fp4lab and JAX,
# which this Python does not have (serve.py itself imports neither)
SERVE = runpy.run_path(str(Path(__file__).resolve().parents[2] / "experiments" / "serve.py"))


def evaluate(llm, windows: np.ndarray) -> tuple[np.ndarray, float]:
    length = windows.shape[1] - 1
    logits, nll = [], []
    for row in windows:
        llm.reset()  # n_tokens = 0: eval removes every cached position of the sequence
        llm.eval([int(t) for t in row[:-1]])
        z = np.array(llm.scores[:length], np.float32)
        logits.append(z)
        z64 = z.astype(np.float64)
        m = z64.max(-1, keepdims=True)
        logp = z64 - m - np.log(np.exp(z64 - m).sum(-1, keepdims=True))
        nll.append(-logp[np.arange(length), row[1:]])
    return np.stack(logits), float(np.mean(nll))


def _load(model: str, length: int):
    """``llama_cpp.Llama`` on the CPU with the weights in their GGUF types, as
    ``python -m experiments.serve`` loads them (its ``load``: llama-cli's ``--no-repack``),
    with every position's logits, a context of ``length``, one batch per window and the KV
    cache in F32."""
    import llama_cpp

    return SERVE["load"](model, n_ctx=max(length, 8), n_batch=length, n_ubatch=length,
                         logits_all=True, n_threads=2, type_k=llama_cpp.GGML_TYPE_F32,
                         type_v=llama_cpp.GGML_TYPE_F32, flash_attn=False)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tokens")
    ap.add_argument("pairs", nargs="+", help="MODEL.gguf OUT.npz, repeated")
    ap.add_argument("--text", default=None)
    args = ap.parse_args(argv)
    if len(args.pairs) % 2:
        raise SystemExit(f"MODEL.gguf OUT.npz pairs expected, got {args.pairs}")
    windows = np.load(args.tokens)
    for model, out in zip(args.pairs[::2], args.pairs[1::2], strict=True):
        llm = _load(model, windows.shape[1] - 1)
        logits, loss = evaluate(llm, windows)
        extra = {}
        if args.text is not None:
            ids = llm.tokenize(args.text.encode(), add_bos=False, special=False)
            extra = {"tokens": np.array(ids, np.int64),
                     "detokenized": np.frombuffer(llm.detokenize(ids), np.uint8)}
        np.savez(out, logits=logits, loss=np.float64(loss), n_vocab=np.int64(llm.n_vocab()),
                 **extra)
        llm.close()


if __name__ == "__main__":
    main(sys.argv[1:])
