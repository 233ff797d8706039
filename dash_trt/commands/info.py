"""``dash-trt``: what this installation has, and its versions.

    dash-trt info [--json]     # package, kernel library, GPU, TensorRT and plugin, ONNX Runtime, torch
    dash-trt info CHECKPOINT   # a model's parameters, active parameters, KV bytes, pool sizes
    dash-trt ocr FILES --server URL --out DIR   # PDFs and images to markdown (dash_trt.commands.ocr)
    dash-trt --version         # the line every command's --version prints

Nothing here needs a GPU, TensorRT or ONNX Runtime: what is missing is reported as missing.
Exit codes: 0 printed; 2 bad arguments; 70 an unexpected internal error.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from .. import __version__
from ..cliutil import EXIT_CODES_NOTE, VERBOSE_HELP, cli_main
from ..versions import version_line

__all__ = ["collect", "main"]


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _kernels() -> dict[str, Any]:
    from ..attention.dash import cuda

    path = cuda.library_path()
    out: dict[str, Any] = {"expected_abi": cuda.ABI_VERSION, "path": str(path) if path else None}
    if path is None:
        out["status"] = (
            "not found (the package was installed without a CUDA compiler; the PyTorch paged operator runs instead)"
        )
        return out
    try:
        out["abi"] = int(cuda._library().dash_abi_version())
        out["head_dims"] = list(cuda.supported_head_dims())
        archs = cuda.compiled_architectures()
        out["architectures"] = list(archs) if archs is not None else None
        out["routing"] = "unlimited-ocr-2" if cuda.routing_rule() == cuda.ROUTING_UNLIMITED_OCR2 else "other"
        out["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        out["status"] = (
            f"cannot be loaded ({type(exc).__name__}: {exc}); a library of another dash-trt version? "
            f"reinstall the package, or point DASH_TRT_LIBRARY at a current build"
        )
    return out


def _gpu() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"available": False}
    devices = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        devices.append(
            {
                "index": i,
                "name": p.name,
                "capability": f"sm_{p.major}{p.minor}",
                "major": p.major,
                "minor": p.minor,
                "memory_gib": round(p.total_memory / 2**30, 1),
            }
        )
    return {"available": True, "devices": devices}


def _tensorrt() -> dict[str, Any]:
    out: dict[str, Any] = {"python_package": None}
    if importlib.util.find_spec("tensorrt") is not None:
        try:
            import tensorrt

            out["python_package"] = getattr(tensorrt, "__version__", "unknown")
        except Exception as exc:  # noqa: BLE001 - a broken install is reported
            out["python_package"] = f"cannot be imported: {type(exc).__name__}: {exc}"
    from ..libraries import STATIC_PLUGIN_NAME, plugin_path, plugin_tensorrt_version

    plugin, static = plugin_path(), plugin_path(STATIC_PLUGIN_NAME)
    out["plugin_library"] = str(plugin) if plugin else None
    out["static_plugin_library"] = str(static) if static else None
    if plugin:
        built = plugin_tensorrt_version(plugin)
        out["plugin_built_for"] = f"TensorRT {built[0]}.{built[1]} headers" if built else "unknown"
        out["plugin_note"] = (
            f"found; it registers its creator only in a TensorRT {built[0]}.x runtime" if built else "found"
        )
    elif os.environ.get("DASH_TRT_PLUGIN"):
        out["plugin_note"] = f"DASH_TRT_PLUGIN={os.environ['DASH_TRT_PLUGIN']} is not a file"
    else:
        out["plugin_note"] = (
            "not in this installation (a wheel built with TensorRT headers carries it; or build it "
            "with cmake -DDASH_BUILD_TRT_PLUGIN=ON and set DASH_TRT_PLUGIN)"
        )
    return out


def _onnxruntime() -> dict[str, Any]:
    dists = sorted(
        d
        for d in ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "onnxruntime-openvino")
        if _dist_version(d)
    )
    out: dict[str, Any] = {"distributions": {d: _dist_version(d) for d in dists}}
    if len(dists) > 1:
        out["warning"] = (
            f"{' and '.join(dists)} are both installed: they write the same onnxruntime module, and the "
            f"one installed last wins"
        )
    if importlib.util.find_spec("onnxruntime") is None:
        out["status"] = "not installed"
        return out
    try:
        import onnxruntime

        out["version"] = onnxruntime.__version__
        out["providers"] = onnxruntime.get_available_providers()
        out["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - reported
        out["status"] = f"cannot be imported: {type(exc).__name__}: {exc}"
    return out


def collect() -> dict[str, Any]:
    """Everything ``dash-trt info`` prints, as a dict."""
    import torch

    return {
        "dash_trt": {"version": __version__, "installed_metadata": _dist_version("dash-trt"), "line": version_line()},
        "torch": {"version": torch.__version__, "cuda": torch.version.cuda},
        "kernels": _kernels(),
        "gpu": _gpu(),
        "tensorrt": _tensorrt(),
        "onnxruntime": _onnxruntime(),
        "onnx": _dist_version("onnx"),
        "triton": {"tritonclient": _dist_version("tritonclient"), "nvidia-pytriton": _dist_version("nvidia-pytriton")},
    }


def _print(info: dict[str, Any], out: TextIO) -> None:
    k, g, t, o = info["kernels"], info["gpu"], info["tensorrt"], info["onnxruntime"]
    print(info["dash_trt"]["line"], file=out)
    print(f"torch {info['torch']['version']} (CUDA {info['torch']['cuda'] or 'none'})", file=out)
    if k.get("status") == "ok":
        archs = ", ".join(k["architectures"]) if k.get("architectures") else "architectures not reported"
        print(
            f"kernel library: {k['path']} (ABI {k['abi']}; {archs}; head dims {', '.join(map(str, k['head_dims']))})",
            file=out,
        )
    else:
        print(f"kernel library: {k['status']}" + (f" [{k['path']}]" if k.get("path") else ""), file=out)
    if g["available"]:
        for d in g["devices"]:
            print(f"GPU {d['index']}: {d['name']} ({d['capability']}, {d['memory_gib']} GiB)", file=out)
        if k.get("status") == "ok" and k.get("architectures"):
            from ..attention.dash.cuda import runs_on

            for d in g["devices"]:
                if not runs_on((d["major"], d["minor"]), k["architectures"]):
                    print(
                        f"WARNING: the kernel library has no code for GPU {d['index']} ({d['capability']}): "
                        f"built for {', '.join(k['architectures'])}",
                        file=out,
                    )
        if k.get("status") != "ok":
            print(
                "WARNING: a GPU is visible but the DASH kernels are not: CUDA tensors run the PyTorch paged "
                "operator, far slower (reinstall with nvcc on PATH)",
                file=out,
            )
    else:
        print("GPU: none visible to torch", file=out)
    print(
        f"TensorRT: {t['python_package'] or 'not installed'}; "
        f"plugin library: {t['plugin_library'] or t['plugin_note']}",
        file=out,
    )
    dists = ", ".join(f"{d} {v}" for d, v in o["distributions"].items()) or "no distribution"
    line = f"ONNX Runtime: {dists}"
    if o.get("status") == "ok":
        line += f"; providers {', '.join(o['providers'])}"
    elif o.get("status"):
        line += f"; {o['status']}"
    print(line, file=out)
    if o.get("warning"):
        print(f"WARNING: {o['warning']}", file=out)
    print(
        f"onnx {info['onnx'] or 'not installed'}; tritonclient {info['triton']['tritonclient'] or 'not installed'}, "
        f"nvidia-pytriton {info['triton']['nvidia-pytriton'] or 'not installed'}",
        file=out,
    )


def _checkpoint_facts(a) -> dict[str, Any]:
    import torch

    from ..models.config import DTYPES
    from ..models.facts import model_facts, read_config

    config = read_config(a.checkpoint)
    facts = model_facts(
        config, dtype=DTYPES[a.dtype] if a.dtype else None, kv_block_size=a.kv_block_size, model_class=a.model
    )
    if a.gpu_memory_gib:
        memories = [(f"{g:g} GiB", g * 2**30) for g in a.gpu_memory_gib]
    elif torch.cuda.is_available():
        memories = [
            (f"GPU {i} ({torch.cuda.get_device_name(i)})", torch.cuda.get_device_properties(i).total_memory)
            for i in range(torch.cuda.device_count())
        ]
    else:
        memories = [("80 GiB (H100)", 80 * 2**30), ("141 GiB (H200)", 141 * 2**30)]
    reserve = a.reserve_gib * 2**30
    pools = []
    for name, mem in memories:
        blocks, tokens = facts.pool(mem * a.memory_fraction, reserve)
        pools.append({"memory": name, "bytes": int(mem), "kv_blocks": blocks, "kv_tokens": tokens})
    return {
        "checkpoint": str(a.checkpoint),
        **facts.to_dict(),
        "memory_fraction": a.memory_fraction,
        "reserve_bytes": int(reserve),
        "pools": pools,
    }


def _print_facts(f: dict[str, Any], out: TextIO) -> None:
    gib = 2**30
    print(f"{f['checkpoint']}: {f['architecture']}, {f['layers']} layers, {f['dtype']}", file=out)
    print(
        f"parameters: {f['parameters']:,} ({f['weight_bytes'] / gib:.2f} GiB); active per token: "
        f"{f['active_parameters']:,}",
        file=out,
    )
    fields = ", ".join(f"{k} {v / f['kv_block_size'] / f['layers']:g}" for k, v in f["cache_bytes_by_field"].items())
    print(
        f"KV cache: {f['kv_bytes_per_token_per_layer']:g} bytes a token a layer ({fields}); one block of "
        f"{f['kv_block_size']} tokens in all layers {f['block_bytes'] / 2**20:.3f} MiB",
        file=out,
    )
    for p in f["pools"]:
        print(
            f"pool on {p['memory']} x {f['memory_fraction']:g}, less the weights and {f['reserve_bytes'] / gib:g} "
            f"GiB: {p['kv_blocks']:,} blocks, {p['kv_tokens']:,} tokens",
            file=out,
        )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dash-trt",
        description="What this dash-trt installation has.",
        epilog="Exit codes: 0 printed, 2 bad arguments, " + EXIT_CODES_NOTE,
    )
    p.add_argument("--version", action="version", version=version_line())
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser(
        "info",
        help="the package, kernel library, GPU, TensorRT, ONNX Runtime and torch found",
        epilog="Exit codes: 0 printed, 2 bad arguments, " + EXIT_CODES_NOTE,
    )
    i.add_argument(
        "checkpoint",
        nargs="?",
        help="a model (checkpoint folder, config.json or model.pt): print its parameters, active parameters a "
        "token, KV cache bytes a token a layer and the KV pool a GPU's memory holds, instead of the installation",
    )
    i.add_argument("--model", help="the model class (module:Class or file.py:Class), as dash-export takes it")
    i.add_argument(
        "--dtype", choices=("float32", "float16", "bfloat16"), help="weights and cache dtype (default: the config's)"
    )
    i.add_argument("--kv-block-size", type=int, default=16, help="tokens per KV block (16)")
    i.add_argument(
        "--gpu-memory-gib",
        type=float,
        action="append",
        help="device memory to size the pool for (repeatable; default: the visible GPUs, else 80 and 141)",
    )
    i.add_argument("--memory-fraction", type=float, default=0.9, help="share of that memory the server may use (0.9)")
    i.add_argument(
        "--reserve-gib", type=float, default=0.0, help="memory kept for activations and the CUDA context (0)"
    )
    i.add_argument("--json", action="store_true", help="one JSON object")
    i.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    from .ocr import add_parser

    add_parser(sub).add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    return p


@cli_main("dash-trt")
def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    out = stdout if stdout is not None else sys.stdout
    if a.command == "ocr":
        from .ocr import ocr_main

        return ocr_main(a, out, sys.stderr)
    if a.checkpoint is not None:
        from ..modeling import ModelContractError
        from ..models.config import ModelConfigError

        if a.kv_block_size < 1 or not 0 < a.memory_fraction <= 1 or a.reserve_gib < 0:
            p.error("--kv-block-size must be >= 1, --memory-fraction in (0, 1], --reserve-gib >= 0")
        if a.gpu_memory_gib and min(a.gpu_memory_gib) <= 0:
            p.error("--gpu-memory-gib must be positive")
        try:
            facts = _checkpoint_facts(a)
        except (ModelConfigError, ModelContractError, OSError) as exc:
            print(f"dash-trt: error: {exc}", file=sys.stderr)
            return 2
        print(json.dumps(facts, indent=1), file=out) if a.json else _print_facts(facts, out)
        return 0
    info = collect()
    if a.json:
        print(json.dumps(info, indent=1), file=out)
    else:
        _print(info, out)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
