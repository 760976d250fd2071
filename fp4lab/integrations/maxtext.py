"""MaxText's own trainer with an fp4lab precision policy.

``python -m fp4lab.integrations.maxtext <maxtext>/configs/base.yml key=value ...
fp4lab.policy=nemotron3`` runs ``maxtext.trainers.pre_train.train`` as MaxText does, with every GEMM
of its NNX model quantized as the policy says. fp4lab's keys (:data:`KEYS`) are taken out of the
command line before MaxText parses its config (MaxText refuses keys it does not know). The policy is
applied where MaxText applies its own qwix quantization (``quantizations. maybe_quantize_model``),
to the model every part of MaxText builds: its trainer, its checkpoints, its abstract model for
shardings. MaxText's ``DenseGeneral`` layers are governed as layers of kind ``densegeneral`` under
their own paths (``decoder/layers/mlp/wi_0``, ``decoder/logits_dense``); attention's products are
``jnp.einsum`` calls that op rules govern.

MaxText is an optional dependency: ``import fp4lab`` never imports this module, and this
module imports MaxText only when it runs (``pip install maxtext==0.2.5`` and its CPU
imports: ``sh scripts/maxtext-venv`` builds that environment).

fp4lab's refusals print as one line, ``error: <message>`` on stderr with exit status 1,
whether the command line refuses them or MaxText's model build does (a policy whose depth
rule splits blocks stacked for a scan, an OutControl recipe, ``quantization=`` beside a
policy). The rule (:func:`is_refusal`): a refusal is a ``ValueError``, ``FileNotFoundError``
or ``ImportError`` that a ``raise`` statement in fp4lab's own source raised. Anything else is
a crash and keeps its traceback: any other exception type, and these types raised by JAX,
NumPy, MaxText or Python itself, also when fp4lab called them (JAX's traceback filtering can
leave an fp4lab frame innermost, but stopped at a call, not at a ``raise``).
"""

from __future__ import annotations

import dataclasses
import dis
import os
import sys

from fp4lab.policy import PrecisionPolicy, get_policy

__all__ = ["KEYS", "Options", "split_args", "install", "quantize", "main", "probe_metrics",
           "probe_scalars", "is_refusal"]

INSTALL = "sh scripts/maxtext-venv (or: pip install maxtext==0.2.5 and its CPU imports)"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
    """fp4lab's keys on MaxText's command line (``fp4lab.<name>=<value>``)."""

    policy: str = "all:bf16"  # a preset, all:<recipe> or file:<policy.json>
    seed: int = 0  # the stochastic-rounding streams' seed (with each GEMM's path)
    backend: str = "auto"  # fp4lab.backend: which implementation quantizes
    strict: bool = True  # a rule that matches no GEMM is an error, not a warning
    probes: str = ""  # metrics of every quantized GEMM operand, each step: "all" or names


KEYS = tuple(f"fp4lab.{f.name}" for f in dataclasses.fields(Options))


def split_args(argv: list[str]) -> tuple[list[str], Options]:
    """MaxText's command line without fp4lab's keys, and fp4lab's :class:`Options`."""
    rest, given = [], {}
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not key.startswith("fp4lab."):
            rest.append(arg)
            continue
        if not eq or key not in KEYS:
            raise ValueError(f"{arg!r}: fp4lab's keys are {', '.join(k + '=...' for k in KEYS)}")
        field = key.removeprefix("fp4lab.")
        kind = {f.name: f.type for f in dataclasses.fields(Options)}[field]
        given[field] = _parse(arg, value, kind)
    options = Options(**given)
    get_policy(options.policy)  # a bad policy fails now, before MaxText starts
    probe_metrics(options)
    return rest, options


def probe_metrics(options: Options) -> tuple[str, ...]:
    """The probe metrics ``fp4lab.probes`` asks for (``all``: every one of
    :data:`fp4lab.numerics.metrics.METRIC_NAMES`; empty: no probes)."""
    from fp4lab.numerics.metrics import METRIC_NAMES

    if options.probes in ("", "all"):
        return METRIC_NAMES if options.probes else ()
    names = tuple(options.probes.split(","))
    unknown = [n for n in names if n not in METRIC_NAMES]
    if unknown:
        raise ValueError(f"fp4lab.probes={options.probes!r}: unknown metric {unknown[0]!r}; "
                         f"give 'all' or some of {', '.join(METRIC_NAMES)}")
    return names


def probe_scalars(model, metrics: tuple[str, ...]) -> dict:
    """MaxText scalar metrics ``fp4lab/<GEMM path>[<block>]/<operand>/<metric>`` from the
    probes of a quantized model whose probes hold their last gradient (MaxText's train step
    sets ``_overwrite_with_gradient`` variables so): every operand a recipe quantizes, except
    those of identity recipes (a BF16 GEMM on BF16 operands runs as written: nothing to
    measure). Traced values, inside the train step."""
    import numpy as np

    from fp4lab.flax.nnx import block_name, probe_rows
    from fp4lab.numerics.metrics import METRIC_NAMES
    from fp4lab.gemm.recipe import OPERANDS

    out = {}
    for name, (recipe, rows) in probe_rows(model).items():
        if recipe.is_identity:
            continue
        for index in np.ndindex(rows.shape[:-2]):
            where = block_name(name, index)
            for op in recipe.quantized_operands:
                for metric in metrics:
                    out[f"fp4lab/{where}/{op}/{metric}"] = rows[index][
                        OPERANDS.index(op), METRIC_NAMES.index(metric)]
    return out


def _parse(arg: str, value: str, kind: str):
    if kind == "int":
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"{arg!r}: not an integer") from None
    if kind == "bool":
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{arg!r}: not true or false")
        return value.lower() in ("true", "1")
    return value


def _maxtext():
    """MaxText's modules, or a clear error naming the install command."""
    try:
        from maxtext.layers import linears, quantizations
    except ImportError as e:
        raise ImportError(f"fp4lab.integrations.maxtext needs MaxText ({e}); install it: "
                          f"{INSTALL}") from None
    return linears, quantizations


def quantize(model, config, options: Options):
    """``model`` (MaxText's NNX ``Transformer``) with ``options.policy`` applied, traced once
    on dummy inputs of the training shape, as MaxText's qwix path traces it."""
    import jax.numpy as jnp
    from flax import nnx

    from fp4lab.flax import assignments, quantize_model

    if not isinstance(model, nnx.Module):
        raise ValueError("fp4lab.integrations.maxtext quantizes MaxText's NNX model; this "
                         f"MaxText built a {type(model).__name__}")
    if config.quantization:  # MaxText's QuantizationType enum: its value is what was typed
        given = getattr(config.quantization, "value", config.quantization)
        raise ValueError(f"quantization={given!r} (MaxText's own quantization) "
                         f"and fp4lab.policy={options.policy!r} would both quantize the "
                         "GEMMs: drop one")
    _check_experts(config, options)
    shape = (config.micro_batch_size_to_train_on, config.max_target_length)
    tokens = jnp.ones(shape, jnp.int32)
    kwargs = {"enable_dropout": False}
    if config.mtp_num_layers > 0:  # the MTP block reads the targets
        kwargs.update(decoder_target_tokens=tokens, decoder_target_mask=tokens)
    if options.probes and config.gradient_accumulation_steps > 1:
        raise ValueError(f"fp4lab.probes={options.probes!r} reads each step's probe "
                         "gradients, which MaxText's train step computes only without "
                         f"gradient accumulation (gradient_accumulation_steps="
                         f"{config.gradient_accumulation_steps})")
    policy: PrecisionPolicy = get_policy(options.policy)
    model = quantize_model(model, policy, tokens, tokens, tokens, call_kwargs=kwargs,
                           seed=options.seed, backend=options.backend, strict=options.strict,
                           probes=bool(options.probes))
    nnx.pop(model, nnx.Intermediate)  # what the trace sowed (as MaxText does after qwix)
    table = assignments(model)
    delayed = sorted({a.recipe.name for a in table if a.recipe.delayed is not None})
    if delayed:
        raise ValueError(f"fp4lab.policy={options.policy!r} gives GEMMs {', '.join(delayed)} "
                         "(delayed scaling): its amax histories roll from their gradient, "
                         "which MaxText's train step does not compute (it differentiates only "
                         "parameters; its _overwrite_with_gradient state is overwritten, not "
                         "rolled); use a current-scaling recipe such as fp8_hybrid")
    _log_once(str(table))
    return model


def _check_experts(config, options: Options) -> None:
    """Refuse the MoE configurations whose expert GEMMs the policy would not reach: MaxText's
    grouped-GEMM kernels (``megablox``, ``use_tokamax_gmm``) compute the experts in Pallas
    kernels that call no ``jax.lax.ragged_dot``."""
    if config.num_experts <= 1:
        return
    kernel = [k for k in ("megablox", "use_tokamax_gmm") if getattr(config, k)]
    if config.sparse_matmul and kernel:
        raise ValueError(f"{kernel[0]}=True computes MaxText's experts (num_experts="
                         f"{config.num_experts}) in grouped-GEMM kernels that "
                         f"fp4lab.policy={options.policy!r} cannot reach; set megablox=False "
                         "use_tokamax_gmm=False (MaxText's jax.lax.ragged_dot path, which "
                         "fp4lab quantizes expert by expert)")


_logged: set[str] = set()


def _log_once(text: str) -> None:
    """Print the assignment table once (MaxText builds the model several times)."""
    if text not in _logged:
        _logged.add(text)
        print(f"fp4lab {text}", flush=True)


def install(options: Options) -> None:
    """Make MaxText apply ``options`` to every model it builds from now on (its
    model-quantization seam; MaxText's own qwix quantization is refused alongside)."""
    from fp4lab.flax.nnx import register_layer

    linears, quantizations = _maxtext()
    register_layer(linears.DenseGeneral, "densegeneral")
    _govern_einsum_experts()
    original = getattr(quantizations.maybe_quantize_model, "__wrapped__",
                       quantizations.maybe_quantize_model)

    def maybe_quantize_model(model, config):
        return quantize(original(model, config), config, options)

    maybe_quantize_model.__wrapped__ = original
    quantizations.maybe_quantize_model = maybe_quantize_model
    if options.probes:
        _log_probes(probe_metrics(options))


def _govern_einsum_experts() -> None:
    """Make MaxText's dense MoE path (``sparse_matmul=False``) compute its expert stacks
    (the ``wi_0``, ``wi_1`` and ``wo`` einsums of ``RoutedMoE.get_einsum``) through
    :func:`fp4lab.flax.expert_einsum`: the same einsum, which the policy governs as an expert
    stack (its dispatch and combine einsums, 0/1 masks, stay as written)."""
    import jax.numpy as jnp
    from maxtext.layers import moe

    from fp4lab.flax import expert_einsum

    original = getattr(moe.RoutedMoE.get_einsum, "__wrapped__", moe.RoutedMoE.get_einsum)

    def get_einsum(self, rhs_mesh_axes=(), einsum_name=None):
        op = original(self, rhs_mesh_axes, einsum_name)
        experts = einsum_name in (moe.WI_0, moe.WI_1, moe.WO)
        return expert_einsum if experts and op is jnp.einsum else op

    get_einsum.__wrapped__ = original
    moe.RoutedMoE.get_einsum = get_einsum


def _log_probes(metrics: tuple[str, ...]) -> None:
    """Make MaxText's pre-training step report the probes among its scalar metrics (its
    TensorBoard and ``metrics_file``)."""
    from flax import nnx
    from maxtext.trainers.pre_train import train

    original = getattr(train.train_step, "__wrapped__", train.train_step)

    def train_step(model, config, state_mesh_shardings, params_shardings, state, *args,
                   **kwargs):
        state, out = original(model, config, state_mesh_shardings, params_shardings, state,
                              *args, **kwargs)
        out["scalar"].update(probe_scalars(nnx.merge(model, state).model, metrics))
        return state, out

    train_step.__wrapped__ = original
    train.train_step = train_step


def _config_path(arg: str) -> str:
    """A config as given, or by name among MaxText's own (``base.yml``)."""
    import os

    if os.path.exists(arg) or not arg.endswith((".yml", ".yaml")):
        return arg
    import maxtext

    bundled = os.path.join(os.path.dirname(maxtext.__file__), "configs", arg)
    if not os.path.exists(bundled):
        raise ValueError(f"config {arg!r} is neither a file nor one of MaxText's configs")
    return bundled


REFUSALS = (ValueError, FileNotFoundError, ImportError)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # fp4lab/


def is_refusal(e: BaseException) -> bool:
    """Whether ``e`` is one of fp4lab's own refusals of its input, which :func:`main` prints
    as one line: one of :data:`REFUSALS` that a ``raise`` statement in fp4lab's source raised
    (the innermost frame of its traceback is in the ``fp4lab`` package, stopped at a
    ``RAISE_VARARGS``). An error of JAX, NumPy or MaxText is not one, also where fp4lab called
    it and JAX's traceback filtering removed the frames below fp4lab's call."""
    if not isinstance(e, REFUSALS) or e.__traceback__ is None:
        return False
    tb = e.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    if not os.path.abspath(code.co_filename).startswith(_PACKAGE):
        return False
    return any(i.offset == tb.tb_lasti and i.opname == "RAISE_VARARGS" and i.arg
               for i in dis.get_instructions(code))


def _exit(e: BaseException):
    """Exit with refusal ``e`` as one line, ``error: <message>``, status 1."""
    message = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    sys.exit(f"error: {message}")


def main(argv: list[str] | None = None) -> None:
    """``python -m fp4lab.integrations.maxtext <base.yml> key=value ... fp4lab.policy=...``:
    MaxText's pre-training trainer (``maxtext.trainers.pre_train.train``) under the policy. fp4lab's
    refusals, from the command line or from the model's build, exit as one line
    (:func:`is_refusal`)."""
    argv = sys.argv if argv is None else argv
    try:
        rest, options = split_args(argv[1:])
        install(options)
        if rest:
            rest[0] = _config_path(rest[0])
    except REFUSALS as e:
        if not is_refusal(e):
            raise
        _exit(e)
    from absl import app
    from maxtext.trainers.pre_train import train

    try:
        app.run(train.main, argv=[argv[0], *rest])
    except REFUSALS as e:
        if not is_refusal(e):
            raise
        _exit(e)


if __name__ == "__main__":
    main()
