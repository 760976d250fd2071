"""Will a run's training step fit in memory? An estimate, checked before anything is
initialized or compiled (:func:`check_memory`, from ``experiments.run_spec.check_data``).

``data.seq_len=100000`` on the default corpus passes every other check, and XLA then
compiles (and ``model.init`` first runs) a step whose einsum attention alone holds
``batch * heads * seq_len^2`` FP32 scores per layer: terabytes. :func:`step_bytes`
estimates the step's peak from its dominant terms, each a count of FP32 arrays of the
shapes the model computes (experiments/model.py), and :func:`check_memory` refuses a config
whose estimate exceeds the memory available, in one line naming the values, the estimate
and the memory.

The counts are an ESTIMATE, rounded up from XLA's own memory analysis of the compiled step
(``compiled.memory_analysis()``: temporaries plus arguments) of small configs of each block
kind, with probes and a quantizing policy (tests/experiments/test_memory.py checks that it
stays above that analysis, and within a small factor of it):

* ``state``: parameters, gradients, two optimizer moments and the update, FP32 (5 copies
  of the parameters), one set per device that shares the memory (the state is replicated);
* ``logits``: 6 arrays of ``batch x seq_len x vocab`` (logits, log-softmax, their
  gradients, the head's quantized operands), twice with the MTP head;
* ``attention`` (einsum): the probabilities saved for the backward pass, 3 arrays of
  ``batch x heads x seq_len^2`` per attention block (scores, mask, probabilities), and 2
  more live while one block runs; flash attention (``model.attention="flash"``) keeps
  ``q, k, v, o`` per block (8 arrays of ``batch x seq_len x d_model``) and a key block of
  scores (4 arrays of ``batch x heads x seq_len x 64``);
* ``ssm``: the Mamba-2 scan's states, 10 arrays of ``batch x seq_len x inner x ssm_state``
  per Mamba block (the parallel scan's levels and their gradients; the recurrent scan of
  ``ssm_state_format`` stores fewer), and 8 of its ``in_proj`` outputs;
* ``mlp``: 8 arrays of ``batch x seq_len x mlp_mult * d_model`` per MLP block;
* ``moe``: per MoE block, 6 arrays of every expert's slot of all ``batch x seq_len x top_k``
  rows, at the experts' input and hidden widths (the grouped GEMM's capacity layout, and
  ``jax.lax.ragged_dot``'s on CPU, hold every row once per expert), and 8 of the rows;
* ``blocks``: 16 arrays of ``batch x seq_len x d_model`` per block (norms, the residual
  stream, quantized operands).

What this leaves out is small beside these at any size where the check matters: the
validation program (forward only), the probes' outputs, XLA's fusion choices.
"""

from __future__ import annotations

import math
import os

import jax

__all__ = ["step_bytes", "available_bytes", "check_memory", "format_bytes"]

F32 = 4
FLASH_BLOCK_K = 64  # fp4lab.beyond.attention's key block


def param_count(cfg) -> int:
    """The parameters of :class:`experiments.model.HybridLM` with ``cfg`` (a
    ``ModelConfig``), counted from its layers' shapes (no trace)."""
    d, v, f = cfg.d_model, cfg.vocab, cfg.mlp_mult * cfg.d_model
    inner, n = cfg.ssm_expand * d, cfg.ssm_state
    heads = inner // cfg.ssm_head_dim
    conv = inner + 2 * n
    block = {"M": d * (2 * inner + 2 * n + heads) + (cfg.conv_width + 1) * conv + 3 * heads
             + inner + inner * d,
             "*": 3 * d * d + d * d,
             "-": 2 * d * f,
             "E": _moe_params(cfg)}
    per_block = d + (d if cfg.residual_gate else 0)  # its norm (and gate)
    total = 2 * v * d + d + sum(block[k] + per_block for k in cfg.pattern)
    if cfg.mtp:
        total += 2 * d + 2 * d * d + block["-"] + per_block + (0 if cfg.mtp_tied_head else d * v)
    return total


def _moe_widths(cfg) -> tuple[int, int]:
    """An MoE block's expert input width (the latent one, if any) and hidden width."""
    return cfg.moe_latent or cfg.d_model, cfg.expert_width


def _moe_params(cfg) -> int:
    d, (z, h) = cfg.d_model, _moe_widths(cfg)
    return (d * cfg.moe_experts + 2 * cfg.moe_experts * z * h
            + (2 * d * z if cfg.moe_latent else 0) + (2 * d * h if cfg.moe_shared else 0))


def step_bytes(cfg, *, batch: int, seq_len: int, replicas: int = 1) -> dict[str, int]:
    """The estimated bytes of one training step of the model ``cfg`` (a ``ModelConfig``, its
    vocabulary the data's) on ``batch`` sequences of ``seq_len`` tokens in one memory, which
    holds ``replicas`` copies of the state; by term (the module docstring)."""
    b, length, d = batch, seq_len, cfg.d_model
    tokens = b * length
    kinds = {k: cfg.pattern.count(k) for k in "M*-E"}
    z, h = _moe_widths(cfg)
    rows = tokens * cfg.moe_top_k  # an expert GEMM's rows, in every expert's slot (qragged_dot)
    mtp = int(cfg.mtp)
    inner, n = cfg.ssm_expand * d, cfg.ssm_state
    ssm_heads = inner // cfg.ssm_head_dim
    if cfg.attention == "flash":
        attention = (kinds["*"] * 8 * tokens * d
                     + 4 * b * cfg.num_heads * length * min(length, FLASH_BLOCK_K)) * F32
    else:
        scores = b * cfg.num_heads * length * length * F32
        attention = (3 * kinds["*"] + 2) * scores + length * length if kinds["*"] else 0
    return {
        "state": replicas * 5 * param_count(cfg) * F32,
        "logits": (1 + mtp) * 6 * tokens * cfg.vocab * F32,
        "attention": attention,
        "ssm": kinds["M"] * (10 * tokens * inner * n + 8 * tokens * (2 * inner + 2 * n
                                                                      + ssm_heads)) * F32,
        "mlp": (kinds["-"] + mtp) * 8 * tokens * cfg.mlp_mult * d * F32,
        "moe": kinds["E"] * (6 * cfg.moe_experts * rows * (z + h) + 8 * rows * z) * F32,
        "blocks": (len(cfg.pattern) + mtp) * 16 * tokens * d * F32,
    }


def _host_available() -> tuple[int, str]:
    """The host memory available now: /proc/meminfo's MemAvailable (else the free pages),
    and less if a cgroup (a container's limit) allows less."""
    available, where = None, "host memory available (MemAvailable)"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        where = "host memory free"
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
        if limit != "max" and int(limit) - used < available:
            available, where = int(limit) - used, "memory left under this cgroup's limit"
    except (OSError, ValueError):
        pass
    return available, where


def available_bytes(device=None) -> tuple[int, str]:
    """The memory a step on ``device`` (default: the first local one) can use, and what it
    is: an accelerator's own (its allocator's limit less what is in use), else the host's
    (:func:`_host_available`; CPU devices share it)."""
    device = jax.local_devices()[0] if device is None else device
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        return (stats["bytes_limit"] - stats.get("bytes_in_use", 0),
                f"{device.platform.upper()} memory of {device} available")
    return _host_available()


def format_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


_TERMS = {"state": "parameters and optimizer state", "logits": "logits",
          "attention": "attention scores", "ssm": "Mamba-2 scan states",
          "mlp": "MLP activations", "moe": "MoE expert slots", "blocks": "block activations"}


def check_memory(config, cfg, n_devices: int, *, devices=None,
                 available: tuple[int, str] | None = None):
    """Refuse (ValueError, one line) a run whose training step, estimated by
    :func:`step_bytes` for the model ``cfg`` (``model_config(config, data)``) over
    ``n_devices`` (data parallelism: each device its share of the batch), needs more than
    the memory available (:func:`available_bytes`, or ``available`` as ``(bytes, what)``):
    the host's for CPU devices (this process's ``devices``, default all local ones, share
    it, each with a copy of the state), else each accelerator's own."""
    d = config.data
    local = jax.local_devices() if devices is None else list(devices)
    on_host = local[0].platform == "cpu"
    share = len(local) if on_host else 1  # the devices that use one memory
    batch = math.ceil(d.batch_size * share / n_devices)
    terms = step_bytes(cfg, batch=batch, seq_len=d.seq_len, replicas=share)
    need = sum(terms.values())
    have, what = available if available is not None else available_bytes(local[0])
    if need <= have:
        return
    top = sorted(terms, key=terms.get, reverse=True)[:2]
    parts = ", ".join(f"{_TERMS[k]} {format_bytes(terms[k])}" for k in top)
    hint = ("; model.attention='flash' keeps no seq_len^2 scores" if top[0] == "attention"
            and cfg.attention == "einsum" else "")
    per = "" if on_host else " per device"
    raise ValueError(
        f"data.seq_len={d.seq_len} with data.batch_size={d.batch_size}: the training step "
        f"needs an estimated {format_bytes(need)}{per} ({parts}), more than the "
        f"{format_bytes(have)} of {what}; lower data.seq_len or data.batch_size{hint}")
