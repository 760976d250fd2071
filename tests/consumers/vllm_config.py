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
   registry for the config's architecture): vLLM keeps one global scale per fused layer.

Prints what vLLM decided, one ``key: value`` per line, then ``RESULT {json}`` per folder.
Exit status 1 if any folder fails: no method detected, ``from_config`` raising, a quantized
module that vLLM would treat as unquantized (or the reverse), or a parameter vLLM registers
that the checkpoint lacks (W4A4 NVFP4 without ``input_scale``: vLLM would read uninitialized
memory as the activation scale), or shards of one fused layer with different global
scales (vLLM would dequantize all but one of them off by the ratio).
"""

import json
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


def linear_modules(tensors: dict, index: dict) -> dict[str, dict]:
    """module -> {"quantized": bool, "in": K, "out": N} for the checkpoint's linear layers:
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
            continue  # an expert stack or other N-d kernel: not a Linear
        n, k = shape
        modules[module] = {"quantized": quantized, "out": n, "in": 2 * k if quantized else k}
    return modules


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


def check(folder: Path) -> tuple[dict, list[str]]:
    from vllm.config import LoadConfig
    from vllm.model_executor.model_loader.weight_utils import get_quant_config

    tensors, index = header(folder)
    modules = linear_modules(tensors, index)
    out = {"folder": str(folder), "modules": {}}
    if not any(m["quantized"] for m in modules.values()):
        return out, [f"{folder}: no quantized linear module in fp4lab's index"]
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
    return out, fails + fused_scales(folder, mc, modules, out)


def report(out: dict, fails: list[str]) -> None:
    print(f"== {out['folder']}")
    for key, value in out.items():
        if key not in ("folder", "modules"):
            print(f"{key}: {json.dumps(value, default=str)}")
    groups: dict[str, list[str]] = {}  # modules that vLLM treats alike, printed once
    for module, entry in out["modules"].items():
        groups.setdefault(json.dumps(entry, default=str), []).append(module)
    for entry, modules in groups.items():
        print(f"modules {modules}:")
        for key, value in json.loads(entry).items():
            print(f"    {key}: {json.dumps(value)}")
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
