"""Probe records and their summaries, and the naming of layers by role and depth.

* :func:`probe_records`: ``{layer: {operand: {metric: value}}}`` from one step's probe
  gradient (the library's ``probe_table`` for each layer);
* :func:`summarize_probes`: the mean over the probe steps of each layer/operand/metric, and
  :func:`underflow_by_kind`: the mean underflow of every layer kind (the sweep's columns);
* :func:`layer_kind` (``blocks_3/mamba/out_proj`` -> ``mamba/out_proj``), :data:`KIND_ORDER`
  and :func:`layer_order`, the sort key of tables and heatmaps.
"""

from __future__ import annotations

import re

import numpy as np

from fp4lab.features.probes import probe_table

__all__ = ["probe_records", "summarize_probes", "underflow_by_kind", "layer_kind",
           "layer_order", "KIND_ORDER"]

KIND_ORDER = ("mamba/in_proj", "mamba/out_proj", "attention/qkv", "attention/out", "mlp/up",
              "mlp/down", "moe/router", "moe/latent_down", "moe/experts/ragged_dot_0",
              "moe/experts/ragged_dot_1", "moe/latent_up", "moe/shared_expert/up", "moe/shared_expert/down",
              "head")


def layer_kind(path: str) -> str:
    """``blocks_3/mamba/out_proj`` -> ``mamba/out_proj`` (the layer's role, without depth;
    an expert stack's experts, ``.../expert_5``, are the stack's)."""
    return re.sub(r"/expert_\d+$", "", re.sub(r"(?:^|(?<=/))blocks_\d+/", "", path))


def layer_order(path: str):
    """Sort key: block index (layers outside blocks last), then the role in KIND_ORDER."""
    m = re.match(r"blocks_(\d+)/", path)
    kind = layer_kind(path)
    return (int(m.group(1)) if m else 1 << 30,
            KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER), path)


def probe_records(probe_grads: dict) -> dict:
    """``{layer: {operand: {metric: value}}}`` from the probes' gradient (host arrays); an
    expert stack's probe (one table per expert) gives a layer per expert, ``.../expert_e``."""
    out = {}

    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, prefix + [k])
                continue
            # a layer's "gemm", or an intercepted op's (einsum_0, ragged_dot_0, ...)
            name = "/".join(prefix if k == "gemm" else prefix + [k])
            if np.ndim(v) == 3:
                out.update({f"{name}/expert_{e}": probe_table(t) for e, t in enumerate(v)})
            else:
                out[name] = probe_table(v)

    walk(probe_grads, [])
    return out


def summarize_probes(records: list[dict]) -> dict:
    """Mean over probe steps of each layer/operand/metric (NaN: operand not quantized)."""
    if not records:
        return {}
    layers = records[0]["probes"]
    out = {}
    for layer, ops in layers.items():
        out[layer] = {op: {m: float(np.nanmean([r["probes"][layer][op][m] for r in records]))
                           if any(np.isfinite(r["probes"][layer][op][m]) for r in records)
                           else float("nan") for m in metrics} for op, metrics in ops.items()}
    return out


def underflow_by_kind(summary: dict) -> dict[str, float]:
    """Mean underflow over the quantized operands of every layer of each kind."""
    by = {}
    for layer, ops in summary.items():
        vals = [v["underflow"] for v in ops.values() if np.isfinite(v["underflow"])]
        by.setdefault(layer_kind(layer), []).extend(vals)
    return {k: float(np.mean(v)) if v else float("nan") for k, v in sorted(by.items())}
