"""What vLLM's own configuration code decides about a quantized checkpoint folder (run by
the vLLM environment's Python, scripts/vllm-venv; never by fp4lab's):

    python tests/consumers/vllm_config.py FOLDER [FOLDER ...]

For each folder, as vLLM does when it starts a model:

1. ``vllm.config.ModelConfig(model=FOLDER)``: reads ``config.json`` (or, without a
   ``quantization_config`` there, ``hf_quant_config.json``), normalizes it
   (``model_arch_config_convertor._normalize_quantization_config``) and picks the
   quantization method (``ModelConfig._verify_quantization``, with every method's
   ``override_quantization_method``);
2. ``get_quant_config``: the method's ``from_config`` on that configuration;
3. for every linear module of the checkpoint (fp4lab's ``fp4lab.tensors`` index says which
   tensors are kernels and which are quantized), the method's own dispatch on a vLLM
   ``ReplicatedLinear`` of the module's shape: excluded or quantized, and how. ModelOpt:
   ``get_quant_method`` and ``resolve`` (the weight and activation QuantKeys), then the
   parameters the method registers (``wkey``/``akey``/format scheme ``create_weights``),
   compared with the checkpoint's tensors by name, dtype and size. compressed-tensors: the
   module's scheme arguments (``get_scheme_dict``) and the scheme class
   ``_get_scheme_from_parts`` builds (on a machine without an NVFP4 GEMM, vLLM's kernel
   selection refuses the scheme; the scheme it chose is read off that refusal and the
   kernel's reason printed);
4. the shards that vLLM's model class fuses (``packed_modules_mapping``, from vLLM's model
   registry for the config's architecture): vLLM keeps one global scale per fused layer;
5. every expert stack (index modules ``<stack>.<j>.<proj>``, ``<stack>`` ending in
   ``.experts``; left out of 3 and 4): vLLM has no Linear for them but one fused-MoE layer
   per stack, built here by vLLM's ``FusedMoEFactory`` with NemotronH's arguments
   (models/nemotron_h.py:229-253) at the stack's shape and the quantization config: the
   method it dispatches to (ModelOpt: ``get_quant_method``, exclusion by substring of
   ``ignore``, modelopt.py:191-264; compressed-tensors: ``get_moe_method``, the schemes of
   ``<stack>.0.up_proj``/``.0.None``/``.0.down_proj``, compressed_tensors_moe.py:27-58), the
   parameters it registers, and every checkpoint tensor of the stack loaded through vLLM's
   ``RoutedExperts.load_weights`` (its ``build_expert_params_mapping`` names, its
   ``weight_loader``) and read back. Two refusals of a machine without a GPU are answered
   as on a CUDA GPU and printed (``GpuAnswers``); the kernels' weight processing
   (``process_weights_after_loading``) does not run.

Prints what vLLM decided, one ``key: value`` per line, then ``RESULT {json}`` per folder
(expert stacks under its ``experts`` key). Exit status 1 if any folder fails: no method
detected, ``from_config`` raising, a quantized module or expert stack that vLLM would treat
as unquantized (or the reverse), or a parameter vLLM registers that the checkpoint lacks
(W4A4 NVFP4 without ``input_scale``: vLLM would read uninitialized memory as the activation
scale; vLLM 0.33 checks nothing of the kind for a quantized model, default_loader.py:510-520),
or shards of one fused layer with different global scales (vLLM would dequantize all but one
of them off by the ratio), or, for an expert stack, a dispatch that raises, a checkpoint
tensor that no parameter takes, or one that vLLM's loader stores as other values.
"""

import json
import re
import struct
import sys
import tempfile
import traceback
from pathlib import Path

import torch

SAFETENSORS_DTYPES = {"U8": torch.uint8, "F8_E4M3": torch.float8_e4m3fn, "F32": torch.float32,
                      "BF16": torch.bfloat16, "F16": torch.float16, "I8": torch.int8}


def header(folder: Path) -> tuple[dict, dict]:
    """The tensors (name -> (dtype, shape)) of the folder's ``*.safetensors`` files and
    fp4lab's index (``fp4lab.tensors``; ``{}`` if absent)."""
    tensors, index = {}, {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            head = json.loads(fh.read(n))
        meta = head.pop("__metadata__", None) or {}
        index.update(json.loads(meta.get("fp4lab.tensors", "{}")))
        for name, info in head.items():
            tensors[name] = (SAFETENSORS_DTYPES.get(info["dtype"], info["dtype"]),
                             tuple(info["shape"]))
    return tensors, index


EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.([^.]+)$")


def kernel_modules(tensors: dict, index: dict) -> dict[str, dict]:
    """module -> {"quantized": bool, "in": K, "out": N} for the checkpoint's 2-D kernels:
    fp4lab's index names kernels (``.../kernel``) and their format; a quantized weight is
    stored packed (two codes a byte)."""
    modules = {}
    for key, entry in index.items():
        if not entry["path"].endswith("/kernel"):
            continue
        quantized = entry.get("format") == "nvfp4"
        module = key.rsplit(".", 1)[0]
        _, shape = tensors[key]
        if len(shape) != 2:
            continue  # an N-d kernel: not a Linear
        n, k = shape
        modules[module] = {"quantized": quantized, "out": n, "in": 2 * k if quantized else k}
    return modules


def linear_modules(modules: dict) -> dict[str, dict]:
    """The kernels vLLM builds a Linear for: all but the experts'."""
    return {m: shape for m, shape in modules.items() if not EXPERT.match(m)}


def expert_stacks(modules: dict) -> dict[str, dict]:
    """stack -> {expert: {projection: shape}} for the kernels named
    ``<stack>.<expert>.<projection>`` with ``<stack>`` ending in ``.experts``."""
    stacks: dict[str, dict] = {}
    for module, shape in modules.items():
        if m := EXPERT.match(module):
            stack, expert, proj = m.groups()
            stacks.setdefault(stack, {}).setdefault(int(expert), {})[proj] = shape
    return stacks


def detect(folder: Path):
    """vLLM's ModelConfig on the folder: its quantization method and the raw config."""
    from vllm.config import ModelConfig

    mc = ModelConfig(model=str(folder), skip_tokenizer_init=True)
    raw = getattr(mc.hf_config, "quantization_config", None)
    return mc, raw


def single_process_group(scratch: Path) -> None:
    """vLLM's parameters take their tensor-parallel rank from its process group: one
    process, CPU (gloo), initialized through a file, as vLLM's own CPU tests do."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{scratch / 'pg'}")
        ensure_model_parallel_initialized(1, 1)


def layer(module: str, shape: dict):
    from vllm.model_executor.layers.linear import ReplicatedLinear

    return ReplicatedLinear(shape["in"], shape["out"], bias=False, quant_config=None,
                            prefix=module, params_dtype=torch.bfloat16, disable_tp=True)


def modelopt_params(method, shape: dict) -> tuple[dict, dict]:
    """The parameters vLLM's ModelOpt linear method registers for a layer of this shape
    (required: weight and activation schemes; optional: the format scheme's), as
    ``{name: (dtype, numel)}``; the kernel selection that follows is not run."""
    from vllm.model_executor.layers.quantization.modelopt import ACT, WEIGHT, Shapes

    shapes = Shapes([shape["out"]], shape["in"], torch.bfloat16)
    required, optional = torch.nn.Module(), torch.nn.Module()
    method.wkey.create_weights(required, WEIGHT, method.ctx, shapes, None)
    if method.akey:
        method.akey.create_weights(required, ACT, method.ctx, shapes, None)
    method.fmt.extra_weights(optional, shapes, method.ctx, None)

    def table(m):
        return {n: (p.dtype, p.numel()) for n, p in m.named_parameters()}

    return table(required), table(optional)


def check_params(module: str, tensors: dict, required: dict, optional: dict) -> list[str]:
    fails = []
    ours = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == module}
    for name, (dtype, numel) in {**required, **optional}.items():
        if name not in ours:
            if name in required:
                fails.append(f"{module}: vLLM registers {name} ({dtype}, {numel} values) "
                             "and the checkpoint has no such tensor: it would stay "
                             "uninitialized (torch.empty)")
            continue
        got_dtype, got_shape = ours[name]
        got_numel = int(torch.tensor(got_shape).prod()) if got_shape else 1
        if (got_dtype, got_numel) != (dtype, numel):
            fails.append(f"{module}.{name}: checkpoint {got_dtype} {list(got_shape)}, "
                         f"vLLM {dtype} of {numel} values")
    for name in sorted(set(ours) - set(required) - set(optional)):
        fails.append(f"{module}.{name}: in the checkpoint, not a parameter vLLM registers")
    return fails


def modelopt(qc, modules: dict, tensors: dict, out: dict) -> list[str]:
    from vllm.model_executor.layers.quantization.modelopt import ModelOptLinearMethod

    out.update(quant_algo=qc.quant_method, group_size=getattr(qc, "group_size", None),
               kv_cache_quant_algo=getattr(qc, "kv_cache_quant_algo", None),
               exclude_modules=qc.exclude_modules)
    fails = []
    for module, shape in sorted(modules.items()):
        method = qc.get_quant_method(layer(module, shape), module)
        quantized = isinstance(method, ModelOptLinearMethod)
        entry = {"method": type(method).__name__}
        if quantized:
            entry.update(weight=str(method.spec.weight), activation=str(method.spec.activation))
            required, optional = modelopt_params(method, shape)
            entry["params"] = sorted(required) + [f"({n})" for n in sorted(optional)]
            fails += check_params(module, tensors, required, optional)
        if quantized != shape["quantized"]:
            fails.append(disagreement(module, shape, f"dispatches it to {type(method).__name__}"))
        out["modules"][module] = entry
    return fails


def disagreement(module: str, shape: dict, vllm_does: str) -> str:
    kind = "NVFP4" if shape["quantized"] else "unquantized"
    return f"{module}: the checkpoint's weight is {kind}, vLLM {vllm_does}"


def ct_scheme(qc, args: dict, module: str) -> tuple[str, str]:
    """The scheme class vLLM's compressed-tensors config builds for ``args``, and the kernel
    it selected or the reason none can run here."""
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        CompressedTensorsScheme,
    )

    try:
        scheme = qc._get_scheme_from_parts(
            weight_quant=args.get("weights"), input_quant=args.get("input_activations"),
            output_quant=args.get("output_activations"), format=args.get("format"),
            layer_name=module)
        return describe_scheme(scheme), type(getattr(scheme, "kernel", None)).__name__
    except Exception as e:  # the scheme's constructor selecting a kernel this machine lacks
        for frame, _ in traceback.walk_tb(e.__traceback__):
            scheme = frame.f_locals.get("self")
            if isinstance(scheme, CompressedTensorsScheme):
                return describe_scheme(scheme), f"none on this machine ({e})"
        raise


def describe_scheme(scheme) -> str:
    extra = {k: v for k, v in vars(scheme).items() if k in ("use_a16", "group_size")}
    return f"{type(scheme).__name__}{extra}"


def compressed_tensors(qc, modules: dict, tensors: dict, out: dict) -> list[str]:
    out.update(format=qc.quant_format, ignore=qc.ignore,
               kv_cache_scheme=qc.kv_cache_scheme)
    fails = []
    for module, shape in sorted(modules.items()):
        args = qc.get_scheme_dict(layer(module, shape), module)
        entry = {"method": "UnquantizedLinearMethod" if args is None else
                 "CompressedTensorsLinearMethod"}
        quantized = args is not None and args.get("weights") is not None
        if quantized:
            w, a = args["weights"], args.get("input_activations")
            entry.update(weights=w.model_dump(exclude_defaults=True),
                         input_activations=None if a is None else a.model_dump(
                             exclude_defaults=True))
            entry["scheme"], entry["kernel"] = ct_scheme(qc, args, module)
        if quantized != shape["quantized"]:
            fails.append(disagreement(module, shape, "treats it as "
                                      + ("quantized" if quantized else "unquantized")))
        out["modules"][module] = entry
    return fails


GLOBAL_SCALES = ("weight_scale_2", "input_scale", "weight_global_scale", "input_global_scale")


def fused_scales(folder: Path, mc, modules: dict, out: dict) -> list[str]:
    """vLLM fuses the shards its model class names (``packed_modules_mapping``: Llama's
    q/k/v_proj into qkv_proj, gate/up_proj into gate_up_proj) into one layer with ONE
    global scale, the shards' max (modelopt.py:2093 and 2126, compressed-tensors'
    compressed_tensors_w4a4_nvfp4.py:111 and 124), and only warns when they differ: every
    shard with another scale then dequantizes (or quantizes its input) off by the ratio.
    The shards of one fused layer must therefore carry equal global scales."""
    from safetensors import safe_open

    cls, _ = mc.registry.resolve_model_cls(mc.architectures, model_config=mc)
    packed = dict(getattr(cls, "packed_modules_mapping", {}) or {})
    out["fused"] = packed
    values = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            values.update({k: st.get_tensor(k).float().reshape(-1).tolist() for k in st.keys()
                           if k.rsplit(".", 1)[1] in GLOBAL_SCALES})
    fails = []
    for fused, shards in packed.items():
        for module in sorted(modules):
            prefix, _, last = module.rpartition(".")
            if last != shards[0]:
                continue
            for scale in GLOBAL_SCALES:
                got = {s: values.get(f"{prefix}.{s}.{scale}") for s in shards}
                if all(v is None for v in got.values()) or len({str(v) for v in
                                                                got.values()}) == 1:
                    continue
                fails.append(f"{prefix}.{fused}: vLLM fuses {shards} and keeps the max of "
                             f"their {scale}, which differ: {got}")
    return fails


class GpuAnswers:
    """The two questions on which vLLM 0.33 refuses an NVFP4 fused-MoE layer on a machine
    without a GPU (here vLLM's ``UnspecifiedPlatform``), answered as on a CUDA GPU, each
    answer recorded in ``given``:

    - ``FusedMoEConfig.__post_init__`` refuses a non-gated MoE (NemotronH's relu2) on any
      platform but CUDA, ROCm and XPU (fused_moe/config.py:1410-1415): where it does, it is
      run again with ``current_platform.is_cuda_alike()`` answering yes;
    - ``select_nvfp4_moe_backend`` (fused_moe/oracle/nvfp4.py:191-321) asks each kernel class
      of each backend, in vLLM's order, ``is_supported_config``, whose first test is
      ``_supports_current_device`` (modular_kernel.py:590): every class that says no here is
      offered, for the selection only, as a subclass that says yes. vLLM's order and every
      other test (non-gated, activation, quantization scheme, routing, hidden size) still
      decide; the method keeps the real class.
    """

    def __init__(self):
        self.given: list[str] = []

    def moe_config_cls(self):
        from vllm.model_executor.layers.fused_moe import config as moe_config

        given = self.given

        class MoEConfig(moe_config.FusedMoEConfig):
            def __post_init__(self):
                try:
                    super().__post_init__()
                except NotImplementedError as e:
                    if "is_act_and_mul=False" not in str(e):
                        raise
                    given.append(f"FusedMoEConfig: {e!s} (config.py:1410-1415): answered "
                                 "as on CUDA")
                    platform = moe_config.current_platform

                    class CudaAlike:
                        def __getattr__(self, name):
                            return getattr(platform, name)

                        def is_cuda_alike(self):
                            return True

                    moe_config.current_platform = CudaAlike()
                    try:
                        super().__post_init__()
                    finally:
                        moe_config.current_platform = platform

        return MoEConfig

    def __enter__(self):
        from vllm.model_executor.layers.fused_moe.oracle import nvfp4

        self.oracle, self.kernels = nvfp4, nvfp4.backend_to_kernel_cls

        def any_device(cls):
            try:
                if cls._supports_current_device():
                    return cls
            except Exception:  # a device query this machine cannot answer
                pass
            return type(cls.__name__, (cls,), {"_supports_current_device": staticmethod(
                lambda: True), "real_kernel": cls})

        nvfp4.backend_to_kernel_cls = lambda backend: [any_device(c)
                                                       for c in self.kernels(backend)]
        return self

    def __exit__(self, *exc):
        self.oracle.backend_to_kernel_cls = self.kernels

    def restore(self, method) -> None:
        """Put the real kernel class back in ``method`` and record the answer it needed."""
        cls = getattr(method, "experts_cls", None)
        if real := getattr(cls, "real_kernel", None):
            method.experts_cls = real
            backend = getattr(method, "nvfp4_backend", None)
            self.given.append(f"kernel: {real.__name__} ({getattr(backend, 'value', backend)})"
                              " does not run on this machine; chosen as the first in vLLM's "
                              "order that accepts this layer apart from the device")


def moe_layer(mc, qc, stack: str, shape: dict, answers: GpuAnswers | None):
    """vLLM's fused-MoE layer for ``stack``, as ``NemotronHMoE`` makes it
    (models/nemotron_h.py:229-253): ``FusedMoEFactory`` (fused_moe/layer.py:92), which
    builds ``RoutedExperts`` (its quantization method dispatched by the config through
    ``resolve_quant_method``, ``UnquantizedFusedMoEMethod`` where that gives none,
    routed_experts.py:227-241; its parameters created, :213) inside an ``MoERunner``, with
    NemotronH's routing and activation, its checkpoint names ``("up_proj", "down_proj",
    None)`` and the checkpoint's expert count and sizes (hidden: up_proj's input,
    intermediate: its output). Not passed: the shared experts and latent projections, layers
    of their own, and ``params_dtype``: the model's dtype, as vLLM's loader makes it the
    default while it builds the model."""
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.activation import activation_without_mul
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory
    from vllm.utils.torch_utils import set_default_torch_dtype

    hf = mc.hf_config
    vllm_config = VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(mc.dtype):
        return FusedMoEFactory(
            num_experts=shape["experts"], top_k=hf.num_experts_per_tok,
            hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
            renormalize=hf.norm_topk_prob, quant_config=qc, use_grouped_topk=True,
            num_expert_group=hf.n_group, topk_group=hf.topk_group, prefix=stack,
            scoring_func="sigmoid",
            e_score_correction_bias=torch.nn.Parameter(torch.zeros(shape["experts"])),
            activation=activation_without_mul(hf.mlp_hidden_act),
            routed_scaling_factor=hf.routed_scaling_factor, apply_routed_scale_to_output=True,
            router_logits_dtype=torch.float32, ckpt_names=("up_proj", "down_proj", None),
            moe_config_cls=answers.moe_config_cls() if answers else None)


def refused_method(error: Exception | None):
    """The fused-MoE method vLLM had chosen when ``error`` stopped the layer's construction:
    the ``self`` of the method's frame (its constructor selecting a kernel), if any."""
    from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase

    for frame, _ in traceback.walk_tb(error.__traceback__ if error else None):
        if isinstance(method := frame.f_locals.get("self"), FusedMoEMethodBase):
            return method
    return None


def unused_params(method, params: dict) -> set[str]:
    """The parameters that vLLM registers and then never reads, so that the checkpoint may
    lack them: the activation scales of a weight-only (``use_a16``) NVFP4 method when its
    backend is MARLIN or HUMMING, which drop them (fused_moe/oracle/nvfp4.py:452-453 and
    461-462). Those two are the only backends of vLLM's order (nvfp4.py:203-212) whose
    kernels take NVFP4 weights without an activation key (``_supports_quant_scheme``); B12X
    and FLASHINFER_B12X do too, but only when asked for (``moe_backend``), and are not
    described here. The method registers the scales all the same, ``torch.empty``
    (modelopt.py:1012-1026, compressed_tensors_moe_w4a4_nvfp4.py:168-185)."""
    backend = getattr(getattr(method, "nvfp4_backend", None), "value", None)
    if not getattr(method, "use_a16", False) or backend not in ("MARLIN", "HUMMING"):
        return set()
    return {n for n in params if "input_scale" in n or "input_global_scale" in n}


def slot(param: torch.Tensor, expert: int, shard: str, gated: bool) -> torch.Tensor:
    """Where ``RoutedExperts.weight_loader`` puts one expert's shard of ``param``
    (``_load_w13``, routed_experts.py:529-578; ``_load_per_tensor_weight_scale``, :337-352):
    w13 holds w1 then w3 when gated, w1 alone when not; per-tensor scales one value a
    shard."""
    data = param.data[expert]
    if gated and shard in ("w1", "w3"):
        i = 0 if shard == "w1" else 1
        data = data[i] if data.ndim == 1 else data.narrow(0, i * data.shape[0] // 2,
                                                          data.shape[0] // 2)
    return data


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() != b.numel():
        return False
    a, b = a.reshape(-1).double(), b.reshape(-1).double()
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def config_shape(hf, stack: str, shape: dict) -> list[str]:
    """NemotronHMoE sizes its layer from config.json, not from the tensors
    (models/nemotron_h.py:150-155 and 229-236): ``n_routed_experts``, ``moe_latent_size``
    (``hidden_size`` without it) and ``moe_intermediate_size`` must be the stack's."""
    latent = getattr(hf, "moe_latent_size", None)
    config = {"experts": ("n_routed_experts", getattr(hf, "n_routed_experts", None)),
              "hidden": ("moe_latent_size" if latent is not None else "hidden_size",
                         latent if latent is not None else getattr(hf, "hidden_size", None)),
              "intermediate": ("moe_intermediate_size",
                               getattr(hf, "moe_intermediate_size", None))}
    return [f"{stack}: vLLM sizes the layer by config.json's {key} = {value}; the "
            f"checkpoint's stack: {what} = {shape[what]}"
            for what, (key, value) in config.items() if value != shape[what]]


def moe_stack(mc, qc, model_cls, stack: str, experts: dict,
              tensors: dict[str, torch.Tensor]) -> tuple[dict, list[str]]:
    """vLLM's verdict on one expert stack: the fused-MoE layer ``moe_layer`` builds, its
    method (quantized or not, as the experts are), and the checkpoint's tensors of the stack
    (``tensors``: name -> values) loaded into it by ``RoutedExperts.load_weights``
    (routed_experts.py:1004-1105; through ``MoERunner.load_weights``, as the model's
    ``AutoWeightsLoader`` hands them over), one at a time, after the model's name mapper
    (``hf_to_vllm_mapper.map_name``). A tensor is loaded when vLLM's mapping
    (``get_expert_mapping(include_fused=True)``, i.e. ``build_expert_params_mapping``) names a
    parameter for it, the loader accepts it, and that expert's shard of the parameter reads
    back as the tensor's values. Fails: a method unquantized for NVFP4 experts (or the
    reverse); a raising dispatch, factory or loader; a tensor not loaded; an expert's shard of
    a registered parameter that no tensor fills (it stays ``torch.empty``), unless vLLM never
    reads it (``unused_params``). ``UnquantizedFusedMoEMethod`` selects its kernel on a
    platform question ``GpuAnswers`` does not answer (oracle/unquantized.py:62-106): where
    vLLM dispatches to it, the layer is not built here, the method is read off the refusal
    (``refused_method``) and no parameter is checked."""
    from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.fused_moe.activation import activation_without_mul

    entry: dict = {}
    projections = {p for shapes in experts.values() for p in shapes}
    if projections != {"up_proj", "down_proj"}:
        return entry, [f"{stack}: projections {sorted(projections)}; this check describes "
                       "NemotronH's non-gated experts (up_proj, down_proj) only"]
    kinds = {s["quantized"] for shapes in experts.values() for s in shapes.values()}
    if len(kinds) != 1:
        return entry, [f"{stack}: some expert projections are NVFP4 and some are not; vLLM "
                       "gives the fused layer one quantization method"]
    quantized = kinds.pop()
    up = experts[min(experts)]["up_proj"]
    shape = {"experts": max(experts) + 1, "hidden": up["in"], "intermediate": up["out"]}
    entry.update(shape, activation=activation_without_mul(mc.hf_config.mlp_hidden_act))
    sized = config_shape(mc.hf_config, stack, shape)
    answers, runner, error = None, None, None
    try:
        runner = moe_layer(mc, qc, stack, shape, None)
    except Exception:  # a refusal of this machine, or a real one: ask again
        answers = GpuAnswers()
        try:
            with answers:
                runner = moe_layer(mc, qc, stack, shape, answers)
        except Exception as e:
            error = e
        entry["answered_as_gpu"] = answers.given
    method = runner.routed_experts.quant_method if runner else refused_method(error)
    if answers and method is not None:
        answers.restore(method)
    if method is not None:
        entry.update(method=type(method).__name__,
                     quantized=not isinstance(method, UnquantizedFusedMoEMethod))
        for attr in ("use_a16", "nvfp4_backend", "experts_cls"):
            if (value := getattr(method, attr, None)) is not None:
                entry[attr] = getattr(value, "value", getattr(value, "__name__", value))
    fails = list(sized)
    if method is not None and entry["quantized"] != quantized:
        kind = "NVFP4" if quantized else "unquantized"
        fails.append(f"{stack}: the checkpoint's experts are {kind}, vLLM's fused-MoE layer "
                     f"dispatches to {type(method).__name__}")
    if error is not None:
        if method is None or not fails:
            fails.append(f"{stack}: vLLM's fused-MoE layer: {type(error).__name__}: {error}")
        entry["not_built"] = f"{type(error).__name__}: {error}"
    if len(fails) > len(sized):
        return entry, fails
    routed = runner.routed_experts
    params = {n: p for n, p in routed.named_parameters() if n.startswith(("w13_", "w2_"))}
    entry["params"] = {n: f"{str(p.dtype).removeprefix('torch.')}{list(p.shape)}"
                       for n, p in sorted(params.items())}
    unused = unused_params(method, params)
    entry["unused"] = sorted(unused)
    gated = routed.moe_config.is_act_and_mul
    mapping = routed.get_expert_mapping(include_fused=True)
    mapper = getattr(model_cls, "hf_to_vllm_mapper", None)
    filled, wrong, loaded_tensors = set(), set(), 0
    for name, value in sorted(tensors.items()):
        mapped = mapper.map_name(name) if mapper else name
        if mapped is None or not mapped.startswith(stack + "."):
            fails.append(f"{name}: vLLM's name mapper makes it {mapped!r}, not the stack's")
            continue
        targets = [(mapped.replace(w, p).removeprefix(stack + "."), e, s)
                   for p, w, e, s in mapping if w in mapped]
        if not targets:
            fails.append(f"{name}: no parameter of vLLM's fused-MoE layer takes it (no entry "
                         "of build_expert_params_mapping matches)")
            continue
        try:
            loaded = list(runner.load_weights([(mapped.removeprefix(stack + "."), value)]))
        except Exception as e:
            fails.append(f"{name}: vLLM's loader raises {type(e).__name__}: {e}")
            continue
        for param, expert, shard in targets:
            if f"routed_experts.{param}" not in loaded:
                fails.append(f"{name}: vLLM's loader does not take it into {param}")
            elif not same(got := slot(params[param], expert, shard, gated), value):
                wrong.add((param, expert, shard))
                fails.append(f"{name}: vLLM's loader stores it in {param}[{expert}] ({shard}) "
                             f"as {str(got.dtype).removeprefix('torch.')}{list(got.shape)} "
                             "values other than the checkpoint's "
                             f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}")
            else:
                filled.add((param, expert, shard))
                loaded_tensors += 1
    shards = {"w13": ("w1", "w3") if gated else ("w1",), "w2": ("w2",)}
    for param in sorted(params):
        want = {(param, e, s) for e in range(shape["experts"])
                for s in shards[param.split("_", 1)[0]]}
        missing = sorted(want - filled - wrong)
        if missing and param not in unused and params[param].numel():
            fails.append(f"{stack}.{param}: vLLM registers it ({entry['params'][param]}); no "
                         f"checkpoint tensor fills {[f'{e}:{s}' for _, e, s in missing]}: they "
                         "stay uninitialized (torch.empty)")
    entry["loaded"] = f"{loaded_tensors} of {len(tensors)} checkpoint tensors"
    entry["global_scales"] = {
        n: [float(v) for v in params[n].detach().float().reshape(shape["experts"], -1)[:, 0]]
        for n in sorted(params) if n.endswith(GLOBAL_SCALES)
        and all((n, e, s) in filled for e in range(shape["experts"])
                for s in shards[n.split("_", 1)[0]])}
    return entry, fails


def moe(folder: Path, mc, qc, modules: dict, out: dict) -> list[str]:
    """``moe_stack`` for every expert stack of the folder."""
    from safetensors import safe_open

    stacks = expert_stacks(modules)
    if not stacks:
        return []
    cls, _ = mc.registry.resolve_model_cls(mc.architectures, model_config=mc)
    values = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            values.update({k: st.get_tensor(k) for k in st.keys()
                           if any(k.startswith(s + ".") for s in stacks)})
    fails = []
    for stack, experts in sorted(stacks.items()):
        mine = {k: v for k, v in values.items() if k.startswith(stack + ".")}
        out["experts"][stack], f = moe_stack(mc, qc, cls, stack, experts, mine)
        fails += f
    return fails


def check(folder: Path) -> tuple[dict, list[str]]:
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader.weight_utils import get_quant_config

    tensors, index = header(folder)
    kernels = kernel_modules(tensors, index)
    modules = linear_modules(kernels)
    out = {"folder": str(folder), "modules": {}, "experts": {}}
    if not any(m["quantized"] for m in kernels.values()):
        return out, [f"{folder}: no quantized module in fp4lab's index"]
    mc, raw = detect(folder)
    out.update(quantization=mc.quantization, config_read=raw)
    if mc.quantization is None:
        return out, [f"vLLM detected no quantization method from {raw!r}"]
    try:
        qc = get_quant_config(mc, LoadConfig())
    except Exception as e:
        return out, [f"{mc.quantization} from_config: {type(e).__name__}: {e}"]
    out["config_class"] = type(qc).__name__
    if qc.get_name().startswith("modelopt"):
        fails = modelopt(qc, modules, tensors, out)
    elif qc.get_name() == "compressed-tensors":
        fails = compressed_tensors(qc, modules, tensors, out)
    else:
        return out, [f"vLLM chose {qc.get_name()!r}, which this check does not describe"]
    return out, fails + fused_scales(folder, mc, modules, out) + moe(folder, mc, qc, kernels,
                                                                    out)


def report(out: dict, fails: list[str]) -> None:
    print(f"== {out['folder']}")
    for key, value in out.items():
        if key not in ("folder", "modules", "experts"):
            print(f"{key}: {json.dumps(value, default=str)}")
    groups: dict[str, list[str]] = {}  # modules that vLLM treats alike, printed once
    for module, entry in out["modules"].items():
        groups.setdefault(json.dumps(entry, default=str), []).append(module)
    for entry, modules in groups.items():
        print(f"modules {modules}:")
        for key, value in json.loads(entry).items():
            print(f"    {key}: {json.dumps(value)}")
    for stack, entry in out.get("experts", {}).items():
        print(f"experts {stack} (one fused-MoE layer):")
        for key, value in entry.items():
            print(f"    {key}: {json.dumps(value, default=str)}")
    for f in fails:
        print(f"FAIL: {f}")
    print("RESULT " + json.dumps({**out, "fails": fails, "ok": not fails}, default=str))


def main(folders: list[str]) -> int:
    if not folders:
        print(__doc__, file=sys.stderr)
        return 2
    ok = True
    with tempfile.TemporaryDirectory() as scratch:
        single_process_group(Path(scratch))
    for folder in folders:
        try:
            out, fails = check(Path(folder))
        except Exception as e:
            out, fails = {"folder": folder, "modules": {}}, [f"{type(e).__name__}: {e}"]
            traceback.print_exc()
        report(out, fails)
        ok &= not fails
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
