"""Generate text from a GGUF file with llama.cpp's own code (llama-cpp-python's ``Llama``):
what ``llama-cli`` does, with what this checkout installs.

    .venv/bin/python -m experiments.serve results/serve/qat.gguf --prompt "The " --n-tokens 64

The model is a file ``python -m experiments.export --layout gguf`` wrote (llama.cpp's
``nemotron_h``, with the run's byte vocabulary or its BPE tokenizer), or any GGUF model
llama.cpp runs. llama.cpp tokenizes the prompt with the file's vocabulary (its special
tokens too: ``<|endoftext|>`` in the prompt is the BPE vocabulary's document start), as
``llama-cli -p`` does, generates up to ``--n-tokens`` tokens and stops earlier only at the
end-of-text token that the file names (``tokenizer.ggml.eos_token_id``; the byte vocabulary
has none). stdout gets the prompt and the generated text as raw bytes, streamed, then a
newline; stderr a line with the count and the rate. Sampling is llama-cli's (temperature 0.8,
top-k 40, top-p 0.95, min-p 0.05) from ``--seed`` (default 0: the same text every run);
``--temperature 0`` is greedy; ``--verbose-prompt`` prints the prompt's token ids to stderr
first. The weights stay in their GGUF types (llama-cli's ``--no-repack``: :func:`load`).

Which Python runs llama.cpp: llama-cpp-python is in the consumers' environment
(``.venv-consumers``, scripts/consumer-venv, which ``make test`` builds), not in ``.venv``,
because it is a source build of llama.cpp (11 CPU-minutes) that only serving needs, and the
consumers' Python may be another version than ``.venv``'s (3.11 where torch's CPU wheel is
for 3.11). So when ``llama_cpp`` cannot be imported, this command hands its whole command
line to ``$FP4LAB_CONSUMER_PYTHON``, else ``.venv-consumers/bin/python`` of this checkout,
which runs this file as a script (``os.execv``: one process from then on, with its output
and exit status). One command then works as the README writes it, with every other
``python -m experiments.<x>``; with llama-cpp-python installed where it runs, nothing is
handed over. For that this module imports nothing of fp4lab's or JAX's (the consumers'
Python has neither), and ends a user's mistake with one line, ``error: ...``, and exit
status 2 itself, as ``experiments.commands.command`` does for the other commands.

tests/consumers/llama_eval.py loads its models with :func:`load`
(tests/experiments/test_serving.py runs both).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

__all__ = ["load", "prompt_tokens", "generate", "consumer_python", "main"]

ROOT = Path(__file__).resolve().parents[1]
CONSUMER_VARIABLE = "FP4LAB_CONSUMER_PYTHON"
_HANDED_OVER = "FP4LAB_SERVE_HANDED_OVER"  # set in the Python the command was handed to


def load(model, **kwargs):
    """``llama_cpp.Llama(model_path=model, **kwargs)`` on the CPU (``n_gpu_layers=0``,
    ``verbose=False`` unless given) with the weights in their GGUF types: llama.cpp's extra
    buffer types (``use_extra_bufts``, llama-cli's ``--no-repack``: the weights repacked for
    AMX or AVX2 tiles at load) are off. The Llama class sets no such option, so its default
    model parameters are replaced while it loads. On an AMX CPU (Sapphire Rapids), the
    llama.cpp that llama-cpp-python 0.3.36 builds crashes in its AMX matrix product on the
    tiny model's Q4_0 weights (SIGSEGV in ggml_backend_amx_mul_mat)."""
    import llama_cpp
    from llama_cpp import llama_cpp as capi

    defaults = capi.llama_model_default_params

    def plain():
        params = defaults()
        params.use_extra_bufts = False
        return params

    capi.llama_model_default_params = plain
    try:
        return llama_cpp.Llama(model_path=str(model), **{"n_gpu_layers": 0, "verbose": False,
                                                         **kwargs})
    finally:
        capi.llama_model_default_params = defaults


def prompt_tokens(llm, prompt: str) -> list[int]:
    """``prompt`` tokenized as llama-cli tokenizes it: with the file's vocabulary, a BOS
    only if the file says to add one (``tokenizer.ggml.add_bos_token``; fp4lab's exports do
    not), special tokens parsed."""
    if llm.metadata.get("tokenizer.ggml.model") == "none":
        raise ValueError("the file's vocabulary is token ids only (tokenizer.ggml.model = "
                         "none: a run on token files without a tokenizer.json beside them), "
                         "so there is no text to tokenize")
    tokens = llm.tokenize(prompt.encode(), add_bos=True, special=True)
    if not tokens:
        raise ValueError(f"--prompt {prompt!r}: no tokens to start from")
    return tokens


def generate(llm, tokens: list[int], n_tokens: int, *, temperature: float = 0.8):
    """The token ids ``llm`` (a :func:`load`ed model) generates after ``tokens``, at most
    ``n_tokens`` of them, up to and without the file's end-of-text token if it names one
    (``tokenizer.ggml.eos_token_id``; llama.cpp's own default for a GPT-2 vocabulary
    without one is id 11, a byte of the byte vocabulary). Sampled by llama-cpp-python's
    ``Llama.generate`` with llama-cli's defaults at ``temperature`` (0: greedy) from the
    seed ``llm`` was given (``Llama.set_seed``)."""
    eos = llm.metadata.get("tokenizer.ggml.eos_token_id")
    eos = None if eos is None else int(eos)
    for count, token in enumerate(llm.generate(tokens, temp=temperature), 1):
        if token == eos:
            return
        yield token
        if count == n_tokens:
            return


def consumer_python() -> Path:
    """The Python that has llama-cpp-python: ``$FP4LAB_CONSUMER_PYTHON``, else
    ``.venv-consumers/bin/python`` of this checkout."""
    return Path(os.environ.get(CONSUMER_VARIABLE) or ROOT / ".venv-consumers" / "bin" / "python")


def _hand_over(argv: list[str]) -> None:
    """Run this command in the consumers' Python instead (never returns), or say why not."""
    py = consumer_python()
    if os.environ.get(_HANDED_OVER):
        raise ValueError(f"llama-cpp-python is not importable in {sys.executable} either "
                         f"(the command was handed to it as {CONSUMER_VARIABLE} or "
                         ".venv-consumers): `sh scripts/consumer-venv` installs it")
    if not py.is_file():
        raise ValueError(f"llama-cpp-python is not installed in {sys.executable}, and there is "
                         f"no {py} to run it: `sh scripts/consumer-venv` builds "
                         f".venv-consumers (make test does), or set {CONSUMER_VARIABLE}")
    sys.stdout.flush()
    sys.stderr.flush()
    # -P: without this file's folder first on sys.path, where experiments/tokenize.py would
    # shadow the standard library's tokenize (Python >= 3.11, as scripts/consumer-venv makes)
    os.execve(py, [str(py), "-P", str(Path(__file__).resolve()), *argv],
              {**os.environ, _HANDED_OVER: "1"})


def _serve(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.serve",
        description="Generate text from a GGUF model with llama.cpp (llama-cpp-python; run "
                    "in the consumers' Python, .venv-consumers or $FP4LAB_CONSUMER_PYTHON, "
                    "when this one has no llama_cpp). Prints the prompt and what follows.")
    ap.add_argument("model", help="a .gguf file (python -m experiments.export --layout gguf)")
    ap.add_argument("-p", "--prompt", required=True,
                    help="the text to continue (special tokens such as <|endoftext|> parsed)")
    ap.add_argument("-n", "--n-tokens", type=int, default=64,
                    help="how many tokens to generate at most (default 64)")
    ap.add_argument("--temperature", type=float, default=0.8,
                    help="sampling temperature (default 0.8, as llama-cli; 0: greedy)")
    ap.add_argument("--seed", type=int, default=0, help="the sampler's seed (default 0)")
    ap.add_argument("--verbose-prompt", action="store_true",
                    help="print the prompt's token ids to stderr first (as llama-cli's)")
    ap.add_argument("--verbose", action="store_true", help="show llama.cpp's own log")
    args = ap.parse_args(argv)
    if args.n_tokens < 1:
        raise ValueError(f"--n-tokens {args.n_tokens}: generate at least 1")
    if not args.temperature >= 0:
        raise ValueError(f"--temperature {args.temperature}: must be >= 0 (0: greedy)")
    if not 0 <= args.seed < 0xFFFFFFFF:  # (llama.cpp's 0xFFFFFFFF: a random seed)
        raise ValueError(f"--seed {args.seed}: must be in [0, {0xFFFFFFFF - 1}]")
    if not Path(args.model).is_file():
        raise FileNotFoundError(f"{args.model}: no such file")
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        _hand_over(argv)
    # the context: room for the prompt (at most a token per byte, and a BOS) and the tokens
    n_ctx = len(args.prompt.encode()) + 1 + args.n_tokens
    try:
        llm = load(args.model, n_ctx=n_ctx, verbose=args.verbose)
    except ValueError as e:  # llama-cpp-python: "Failed to load model from file: ..."
        raise ValueError(f"{args.model}: llama.cpp could not load it as a model (--verbose "
                         "shows why; a file exported with --gguf-arch fp4lab holds fp4lab's "
                         "tensor names, which no engine runs)") from e
    try:
        llm.set_seed(args.seed)  # (Llama(seed=0) would be llama.cpp's random seed)
        _stream(llm, args)
    finally:
        llm.close()
    return 0


def _stream(llm, args) -> None:
    """The prompt and each generated token's bytes to stdout as they come, then the count."""
    tokens = prompt_tokens(llm, args.prompt)
    if args.verbose_prompt:
        print(f"prompt: {len(tokens)} tokens {tokens}", file=sys.stderr, flush=True)
    out = sys.stdout.buffer
    out.write(args.prompt.encode())
    out.flush()
    start, count = time.perf_counter(), 0
    for token in generate(llm, tokens, args.n_tokens, temperature=args.temperature):
        out.write(llm.detokenize([token]))
        out.flush()
        count += 1
    seconds = time.perf_counter() - start
    out.write(b"\n")
    out.flush()
    print(f"{count} tokens generated in {seconds:.2f} s ({count / seconds:.0f} tokens/s)"
          f"{'' if count == args.n_tokens else ', stopped at the end-of-text token'}",
          file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """The command: a user's mistake (``ValueError``, ``OSError``) ends it with one line,
    ``error: ...``, and exit status 2 (``FP4LAB_TRACEBACK=1`` shows the traceback)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _serve(argv)
    except (ValueError, OSError) as e:
        if os.environ.get("FP4LAB_TRACEBACK"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
