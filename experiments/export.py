"""A trained run as a checkpoint an inference engine runs as a model.

    python -m experiments.export --run results/sweep/runs/q4_0_qat --layout gguf \
        --out results/export/q4_0.gguf [--policy all:q8_0_qat]

The run's last checkpoint, each kernel as the run's model computes it under its policy
(``precision.policy``, or ``--policy``; read from the quantized model's record of its forward
pass: recipe and compute dtype per GEMM), written in ``--layout``:

* ``gguf``: llama.cpp's ``nemotron_h`` (``nemotron_h_moe`` with MoE blocks;
  ``experiments.engines``: tensor names, keys and vocabulary; weights F32/F16/BF16, Q8_0,
  Q4_0, MXFP4 or NVFP4 as the policy gives them, an expert stack one tensor);
* ``bf16``, ``nvfp4`` (compressed-tensors), ``nvfp4_modelopt`` (ModelOpt, weight-only): a
  transformers ``NemotronHForCausalLM`` folder (``experiments.hf_nemotron_h``);
* ``mxfp4`` is refused: gpt-oss's MXFP4 safetensors are loaded by transformers and vLLM for
  gpt-oss's expert stacks only, not for NemotronH's (llama.cpp's MXFP4 is in ``gguf``).

The multi-token-prediction head is left out, and the command says so; it also says so of a
``--policy`` that says something else than the policy the run trained under: that export is
a post-training quantization (PTQ) of the run's weights, not what its training made. A model
with an option the engine cannot compute (``residual_gate``, ``residual_format``, ...) is
refused, naming it, before anything is written; ``--gguf-arch fp4lab`` then writes its
tensors under fp4lab's names, a file llama.cpp's gguf tools read but no engine runs as a
model (the command says that too). A mistake (an ``--out`` of the wrong kind, a missing or
damaged run, the ``export`` extra not installed) is one line. docs/export.md describes every
layout.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from experiments import engines, hf_nemotron_h, policies
from experiments.commands import command
from experiments.model import HybridLM, expert_stacks
from experiments.rollout import token_log_probs
from experiments.runs import load_run, validation_tokens
from fp4lab import export as fp4lab_export
from fp4lab.flax import quantize_model
from fp4lab.policy import policy_to_dict

__all__ = ["export_run", "ptq_note", "validation_logits", "validation_loss", "with_weights",
           "main", "GGUF_ARCHS", "SERVED", "SERVED_LAYOUTS", "Served"]

GGUF_ARCHS = (engines.ARCH, "fp4lab")  # a GGUF file's general.architecture
NO_DENSE_MXFP4 = (
    "layout 'mxfp4' (gpt-oss's MXFP4 safetensors): transformers and vLLM load MXFP4 only for "
    "gpt-oss's expert stacks (transformers' Mxfp4 quantizer replaces GptOss experts alone, "
    "vLLM's gpt-oss path needs model_type gpt_oss), not NemotronH's dense layers or MoE "
    "experts, so no engine would run this folder; for "
    "MXFP4 weights use --layout gguf (llama.cpp's MXFP4 type)")


@dataclasses.dataclass
class _Target:
    """One export being written: the run, its model config, the output, the policy it is
    written under, the GGUF architecture and the metadata every layout records."""

    run: object
    cfg: object
    out: object
    policy: str
    gguf_arch: str

    @property
    def meta(self) -> dict:
        return {"run": self.run.workdir.name, "policy_name": self.policy,
                "seed": self.run.config.seed}

    @property
    def hf_kw(self) -> dict:
        return dict(max_positions=self.run.config.data.seq_len, metadata=self.meta)

    @functools.cached_property
    def record(self):
        """The quantized model's record of its forward pass under the policy."""
        model = quantize_model(HybridLM(self.cfg), policies.without_outcontrol(
            policies.get(self.policy), "experiments.export"))
        inputs, _ = validation_tokens(self.run.config, self.run.data, 1)
        return model.assignments({"params": self.run.params}, inputs,
                                 rngs={"quant": jax.random.key(0)})


def _check_gguf(t: _Target) -> None:
    if t.gguf_arch != "fp4lab":
        engines.check_nemotron_h(t.cfg)


def _check_hf(t: _Target) -> None:
    hf_nemotron_h.check_expressible(t.cfg)
    hf_nemotron_h.check_output(t.out)  # a wrong path fails before the work


def _write_gguf(t: _Target, layout: str):
    if t.gguf_arch == "fp4lab":  # fp4lab's tensor names: no engine runs it as a model
        return fp4lab_export.export({"params": t.run.params}, t.record, t.out, layout,
                                    metadata=t.meta)
    return _save_nemotron_h_gguf(t.run, t.cfg, t.record, t.out, t.meta)


def _write_bf16(t: _Target, layout: str):
    return hf_nemotron_h.write_bf16(t.run.params, t.cfg, t.out, **t.hf_kw)


def _write_hf_nvfp4(t: _Target, layout: str):
    return hf_nemotron_h.write_nvfp4(t.run.params, t.record, t.cfg, t.out, layout=layout,
                                     **t.hf_kw)


@dataclasses.dataclass(frozen=True)
class Served:
    """A layout the command writes: the engine that runs it, the check of the model and the
    output before anything is written, and the writer; or why it is refused."""

    engine: str
    check: Callable[[_Target], None] | None = None
    write: Callable[[_Target, str], object] | None = None
    refusal: str | None = None


# what the command writes, one row per layout (docs/export.md's table of engines)
SERVED = {
    "gguf": Served("llama.cpp (nemotron_h, nemotron_h_moe)", _check_gguf, _write_gguf),
    "bf16": Served("transformers (NemotronHForCausalLM)", _check_hf, _write_bf16),
    "nvfp4": Served("transformers, vLLM (compressed-tensors NVFP4)", _check_hf,
                    _write_hf_nvfp4),
    "nvfp4_modelopt": Served("transformers, vLLM (ModelOpt NVFP4, weight-only)", _check_hf,
                             _write_hf_nvfp4),
    "mxfp4": Served("none: MXFP4 safetensors are loaded for gpt-oss's experts only",
                    refusal=NO_DENSE_MXFP4),
}
SERVED_LAYOUTS = tuple(SERVED)


def export_run(workdir, layout: str, out, *, policy: str | None = None,
               gguf_arch: str = engines.ARCH):
    """Write the run in ``workdir`` as ``layout`` to ``out``, each layer as the run's model
    computes it under its policy (or ``policy``): from the quantized model's record of its
    forward pass (recipe and compute dtype per GEMM). A GGUF file is llama.cpp's
    ``nemotron_h`` model (``gguf_arch``, the default: ``experiments.engines``; a model
    llama.cpp cannot run is refused, naming the option, before anything is written), or
    with ``gguf_arch="fp4lab"`` the tensors under fp4lab's names, which no engine runs as a
    model. Returns the path."""
    return _export(load_run(workdir), layout, out, policy=policy, gguf_arch=gguf_arch)


def ptq_note(run, policy: str) -> str | None:
    """The line that says an export of ``run`` under ``policy`` is a post-training
    quantization, when ``policy`` says something else than the policy the run trained
    under (policies are told apart by what they say, :func:`experiments.policies.fingerprint`,
    not by name); None when it says the same."""
    trained = run.config.precision.policy
    if policies.fingerprint(policies.get(policy)) == policies.fingerprint(policies.get(trained)):
        return None
    return (f"note: run {run.workdir.name!r} was trained under policy {trained!r}; exporting "
            f"it under policy {policy!r} is a post-training quantization (PTQ) of its "
            "weights, not the result of training under that policy (QAT)")


def _export(run, layout: str, out, *, policy: str | None, gguf_arch: str):
    """Write ``run`` as ``layout``: its row of :data:`SERVED` checks, then writes."""
    from experiments.step import model_config

    if gguf_arch not in GGUF_ARCHS:
        raise ValueError(f"gguf_arch={gguf_arch!r}: use one of {GGUF_ARCHS}")
    if layout not in SERVED:
        raise ValueError(f"unknown layout {layout!r}; known: {', '.join(SERVED)}")
    row = SERVED[layout]
    if row.refusal is not None:
        raise ValueError(row.refusal)
    target = _Target(run, model_config(run.config, run.data), out,
                     policy or run.config.precision.policy, gguf_arch)
    row.check(target)
    return row.write(target, layout)


def _save_nemotron_h_gguf(run, cfg, record, out, meta: dict):
    weights = fp4lab_export.quantized_weights({"params": run.params}, record,
                                              experts=expert_stacks(cfg))
    tensors, names = engines.nemotron_h_tensors(weights, cfg)
    try:
        recorded = policy_to_dict(record.policy)
    except ValueError:  # a recipe outside the registry: its name
        recorded = {"name": record.policy.name}
    meta |= {"policy": recorded, "general.name": run.workdir.name,
             "mtp_head": "left out" if cfg.mtp else "none",
             **engines.nemotron_h_metadata(cfg, context_length=run.config.data.seq_len),
             **engines.tokenizer_metadata(run.data, cfg.vocab)}
    return fp4lab_export.save(tensors, out, "gguf", names=names.__getitem__, metadata=meta,
                              arch=engines.arch_of(cfg))


def with_weights(params, weights: dict[str, np.ndarray]) -> dict:
    """``params`` with the arrays of ``weights`` (``{path: array}``, e.g. a consumer's
    dequantized kernels) in place of the parameters at those paths; shapes must agree."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves, left = [], dict(weights)
    for path, leaf in flat:
        key = jax.tree_util.keystr(path, simple=True, separator="/")
        if key in left:
            new = np.asarray(left.pop(key), np.float32)
            if new.shape != leaf.shape:
                raise ValueError(f"{key}: shape {new.shape}, the parameter's is {leaf.shape}")
            leaf = jnp.asarray(new)
        leaves.append(leaf)
    if left:
        raise KeyError(f"weights for paths the parameters do not have: {sorted(left)[:5]}")
    return jax.tree_util.tree_unflatten(treedef, leaves)


def validation_logits(config, params, data, policy, *, dtype=None, batches: int = 2
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(inputs, targets, logits)`` of ``batches`` validation batches
    (:func:`experiments.runs.validation_tokens`) for the run's model under ``policy`` (a name
    of ``experiments.policies`` or a PrecisionPolicy), in ``dtype`` (default: the run's
    compute dtype); float32 logits ``[windows, seq_len, vocab]``."""
    from experiments.step import model_config

    cfg = model_config(config, data)
    if dtype is not None:
        cfg = dataclasses.replace(cfg, dtype=str(jnp.dtype(dtype)))
    model = quantize_model(HybridLM(cfg), policies.without_outcontrol(
        policies.get(policy) if isinstance(policy, str) else policy, "validation_logits"))
    inputs, targets = validation_tokens(config, data, batches)
    logits = jax.jit(lambda p, t: model.apply({"params": p}, t, rngs={
        "quant": jax.random.key(0)})[0])(params, inputs)
    return inputs, targets, logits


def validation_loss(config, params, data, policy, *, dtype=None, batches: int = 2) -> float:
    """The mean next-token loss of :func:`validation_logits`."""
    _, targets, logits = validation_logits(config, params, data, policy, dtype=dtype,
                                           batches=batches)
    return -float(jnp.mean(token_log_probs(logits, targets)))


@command
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Export a trained run's quantized weights for "
                                 "an inference engine.")
    ap.add_argument("--run", required=True, help="a finished run's folder")
    ap.add_argument("--layout", required=True, choices=SERVED_LAYOUTS,
                    help="; ".join(f"{k}: {v.engine}" for k, v in SERVED.items()))
    ap.add_argument("--out", required=True, help="a .gguf file, or a folder for the others")
    ap.add_argument("--policy", default=None, help="instead of the run's own policy")
    ap.add_argument("--gguf-arch", default=engines.ARCH, choices=GGUF_ARCHS,
                    help=f"gguf: {engines.ARCH} (llama.cpp runs it, as {engines.MOE_ARCH} with "
                    "MoE blocks; default) or fp4lab (the "
                    "tensors under fp4lab's names, which no engine runs as a model)")
    args = ap.parse_args(argv)
    from experiments.step import model_config

    run = load_run(args.run)
    if args.policy is not None and args.layout != "bf16":
        note = ptq_note(run, args.policy)
        if note:
            print(note)
    try:
        path = _export(run, args.layout, args.out, policy=args.policy,
                       gguf_arch=args.gguf_arch)
    except ImportError as e:  # the export extra (other mistakes: experiments.commands)
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({args.layout})")
    cfg = model_config(run.config, run.data)
    for line in (engines.notes(cfg, args.gguf_arch) if args.layout == "gguf"
                 else hf_nemotron_h.notes(cfg, args.layout)):
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
