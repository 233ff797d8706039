"""``dash-compare``: every backend against the PyTorch reference, with polygraphy's comparator.

Runners, on the same steps (chunked prefill and decode of random document prompts, each
runner carrying its own caches from step to step):

- ``pytorch``: the reference: the model on CPU, whose DASH layers run the PyTorch paged
  operator;
- ``onnxrt``: ONNX Runtime on the exported file (the model-local ONNX function);
- ``pytorch-cuda``: the model's serving form on the GPU (the runtime's in-place op on the
  CUDA kernels, caches written where they are; when a GPU and the kernel library are present;
  ``--no-cuda`` leaves it out);
- ``tensorrt``: an engine built by ``dash-build`` (``--engine``, with ``--plugin``), when the
  TensorRT Python package is installed.

Every runner's outputs at every step (logits and each ``present.*`` cache) are compared with
the reference by ``polygraphy.comparator.Comparator.compare_accuracy``; per-output error
statistics go to the terminal and, with ``--json``, to a report. Exit codes: 0 all match,
1 a mismatch, 2 bad input or an unavailable backend.

``--save-inputs`` / ``--save-outputs`` write the reference's per-step feeds and outputs in
polygraphy's JSON format, so ``polygraphy run model.onnx --onnxrt --load-inputs inputs.json
--load-outputs reference.json`` checks a backend without this tool (each saved feed carries the
reference's caches of that step, so the steps are independent there).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .cliutil import EXIT_CODES_NOTE, cli_main
from .export_tools import to_numpy, to_torch
from .modeling import DashModel
from .models.families import family_of
from .models.interface import CUDA_KERNELS, TENSORRT, ServedModel
from .models.loader import load_model
from .models.registry import demo_model
from .onnx_graph import GraphReadError, read_graph
from .serving.generate import generate
from .versions import version_line as _version_line

__all__ = ["CompareReport", "compare", "main", "TorchRunner", "InPlaceTorchRunner"]

#: Tolerances against the float32 reference, by the exported dtype (the export check's).
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (5e-2, 5e-2), torch.bfloat16: (2e-1, 1e-1)}


class CompareError(Exception):
    """Bad input or an unavailable backend (exit code 2)."""


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return to_numpy(t.detach().cpu())


def _to_torch(a: np.ndarray) -> torch.Tensor:
    return to_torch(a)


def _runner_base():
    from polygraphy.backend.base import BaseRunner

    return BaseRunner


class TorchRunner(_runner_base()):  # type: ignore[misc]
    """A polygraphy runner over :class:`DashForCausalLM` (feeds and outputs by ONNX name)."""

    def __init__(self, model: DashModel, input_names: Sequence[str], output_names: Sequence[str], name: str):
        super().__init__(name=name)
        self.model = model
        self.input_names = list(input_names)
        self.output_names = list(output_names)

    def activate_impl(self):
        pass

    def deactivate_impl(self):
        pass

    def get_input_metadata_impl(self):
        from polygraphy.common import TensorMetadata

        return TensorMetadata()

    def infer_impl(self, feed_dict):
        device = self.model.device
        args = [_to_torch(feed_dict[n]).to(device) for n in self.input_names]
        with torch.no_grad():
            out = self.model.export_forward(*args)
        return OrderedDict((n, _to_numpy(t)) for n, t in zip(self.output_names, out))


class InPlaceTorchRunner(TorchRunner):
    """The model's serving form (:meth:`DashForCausalLM.forward_paged`: the in-place op, on the
    CUDA kernels on a GPU), as the runtime runs it: the runner keeps its own device caches,
    copies each step's ``past.*`` feed into them, lets the step write them in place and
    returns them as ``present.*``."""

    def __init__(self, model: DashModel, input_names: Sequence[str], output_names: Sequence[str], name: str):
        super().__init__(model, input_names, output_names, name)
        self.n_meta = len(model.input_names())
        self.caches = None

    def infer_impl(self, feed_dict):
        from .attention.dash.ops import CACHE_FIELDS
        from .attention.dash.paged import DashBatch, DashKVCache, flat_cache_tensors

        device = self.model.device
        names = self.input_names
        meta = [_to_torch(feed_dict[n]).to(device) for n in names[: self.n_meta]]
        past = [_to_torch(feed_dict[n]) for n in names[self.n_meta :]]
        mine = flat_cache_tensors(self.caches) if self.caches is not None else []
        if [(t.shape, t.dtype) for t in mine] == [(t.shape, t.dtype) for t in past]:
            for dst, src in zip(mine, past):
                dst.copy_(src)
        else:  # first step, or the feed's pool changed: caches of the feed's own shapes
            n, sbs = len(CACHE_FIELDS), self.model.config.dash.sparse_block_size
            self.caches = [
                DashKVCache(*(t.to(device).clone() for t in past[n * i : n * (i + 1)]), sparse_block_size=sbs)
                for i in range(len(past) // n)
            ]
        ids, coords, tables, lens, qsl, prompts, rows, *images = meta
        counts = np.diff(feed_dict[names[4]])
        batch = DashBatch(
            tables.int(), lens.int(), qsl.int(), prompts.int(), max_query_len=int(counts.max()) if counts.size else 1
        )
        with torch.no_grad():
            logits = self.model.forward_paged(ids, coords, batch, self.caches, rows, *images)
        out = [logits, *flat_cache_tensors(self.caches)]
        return OrderedDict((name, _to_numpy(t)) for name, t in zip(self.output_names, out))


@dataclass
class CompareReport:
    runners: list[str]
    steps: int = 0
    passed: bool = True
    #: runner -> output -> {"max_abs", "mean_abs", "max_rel", "passed"}
    stats: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)  #: runner -> why it did not run

    def to_json(self) -> dict:
        return {
            "runners": self.runners,
            "reference": self.runners[0],
            "steps": self.steps,
            "passed": self.passed,
            "outputs": self.stats,
            "skipped": self.skipped,
        }


def _onnx_io(path: str):
    """(input names, output names, KV block size) of a dash-export file."""
    try:
        graph = read_graph(path)
    except GraphReadError as exc:
        raise CompareError(str(exc)) from None
    ins = [t.name for t in graph.inputs]
    if "input_ids" not in ins or not any(n.startswith("past.") and n.endswith(".key") for n in ins):
        raise CompareError(f"{path}: not a dash-export model (no input_ids / past.*.key inputs)")
    if graph.kv_block_size is None:
        raise CompareError(f"{path}: past.*.key must have a fixed KV block size (dimension 1)")
    return ins, [t.name for t in graph.outputs], graph.kv_block_size


def check_model_matches(onnx_path: str, model: ServedModel) -> None:
    """CompareError naming every way ``model`` is not the model the file was exported from
    (layers, cache shapes, vocabulary), before anything runs."""
    _onnx_io(onnx_path)  # a readable dash-export file
    problems = family_of(model).onnx_mismatches(model, onnx_path, None)
    if problems:
        raise CompareError(f"{onnx_path} was not exported from this checkpoint: " + "; ".join(problems))


def _onnxrt_runner(path: str):
    from .attention.dash.onnx import OnnxRuntimeMissing, import_onnxruntime, ort_session_options

    try:
        ort = import_onnxruntime()
    except OnnxRuntimeMissing as exc:
        raise CompareError(f"{exc}; dash-compare runs the file in it") from None
    from polygraphy.backend.onnxrt import OnnxrtRunner

    try:
        sess = ort.InferenceSession(path, ort_session_options(), providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - ONNX Runtime refuses the file
        raise CompareError(f"{path}: ONNX Runtime cannot load it: {str(exc).splitlines()[0][:400]}") from None
    return OnnxrtRunner(sess, name="onnxrt")


def _tensorrt_runner(engine: str, plugin: str | None):
    try:
        import tensorrt as trt
        from polygraphy.backend.trt import EngineFromBytes, TrtRunner
    except ImportError:
        raise CompareError(
            "TensorRT not found: install the 'tensorrt' Python package (>= 10.8) to compare an engine"
        ) from None
    if plugin is None:
        from .libraries import plugin_path

        found = plugin_path()
        plugin = str(found) if found else None
    if plugin is None or not os.path.isfile(plugin):
        raise CompareError(f"--engine needs --plugin pointing at libdash_trt_plugin.so (got {plugin!r})")
    from .build import load_plugin_library

    problem = load_plugin_library(trt.get_plugin_registry(), plugin)
    if problem:
        raise CompareError(problem)
    with open(engine, "rb") as fh:
        data = fh.read()
    return TrtRunner(EngineFromBytes(data), name="tensorrt")


def default_prompts(model: ServedModel, seed: int) -> list[list[int]]:
    """The check's prompts (the model family's ``check_prompts``)."""
    return family_of(model).check_prompts(model, seed)[0]


def compare(
    onnx_path: str,
    model: ServedModel,
    *,
    engine: str | None = None,
    plugin: str | None = None,
    use_cuda: bool = True,
    seed: int = 0,
    decode_steps: int = 3,
    prefill_chunk: int | None = 40,
    atol: float | None = None,
    rtol: float | None = None,
    save_inputs: str | None = None,
    save_outputs: str | None = None,
    log=print,
) -> CompareReport:
    """Run every available backend next to the reference and compare with polygraphy."""
    from polygraphy.comparator import Comparator, IterationResult, RunResults

    in_names, out_names, kv_block_size = _onnx_io(onnx_path)
    model = model.eval().cpu()
    tol = TOLERANCES.get(model.dtype, TOLERANCES[torch.float32])
    atol = tol[0] if atol is None else atol
    rtol = tol[1] if rtol is None else rtol
    reference = TorchRunner(model, in_names, out_names, "pytorch")
    runners = [reference, _onnxrt_runner(onnx_path)]
    report = CompareReport(runners=[])
    family = family_of(model)
    if engine is not None and family.refuse([TENSORRT]):
        raise CompareError(f"no TensorRT engine of a {family.label}: {family.refuse([TENSORRT])}")
    if family.refuse([CUDA_KERNELS]):
        report.skipped[CUDA_KERNELS] = family.refuse([CUDA_KERNELS])
    elif use_cuda:
        from .attention.dash import cuda as dcuda

        if not torch.cuda.is_available():
            report.skipped["pytorch-cuda"] = "no CUDA device"
        elif not dcuda.available():
            report.skipped["pytorch-cuda"] = "kernel library not built"
        else:
            import copy

            runners.append(InPlaceTorchRunner(copy.deepcopy(model).cuda(), in_names, out_names, "pytorch-cuda"))
    if engine is not None:
        runners.append(_tensorrt_runner(engine, plugin))
    else:
        report.skipped["tensorrt"] = "no --engine given"
    report.runners = [r.name for r in runners]
    results = {r.name: [] for r in runners}
    feeds: list[OrderedDict] = []
    carried: dict[str, list[np.ndarray] | None] = {r.name: None for r in runners}
    n_in = in_names.index(next(n for n in in_names if n.startswith("past.")))
    for r in runners:
        r.activate()
    try:

        def forward(inputs: dict, caches: list):
            # Every runner scores every new token (a stronger check than the sampled rows);
            # generation gets back the rows it asked for.
            wanted = inputs["logits_indices"]
            inputs = dict(inputs, logits_indices=torch.arange(inputs["input_ids"].shape[0]))
            meta = [_to_numpy(inputs[n]) for n in in_names[:n_in]]
            ref_caches = [_to_numpy(c) for c in caches]
            out = None
            for r in runners:
                past = ref_caches if carried[r.name] is None else carried[r.name]
                feed = OrderedDict(zip(in_names, meta[:n_in] + past))
                if r is reference:
                    feed = OrderedDict(zip(in_names, meta[:n_in] + ref_caches))
                    feeds.append(feed)
                res = r.infer(feed, check_inputs=False)
                res = OrderedDict((n, np.array(res[n])) for n in out_names)
                results[r.name].append(IterationResult(outputs=res, runner_name=r.name))
                carried[r.name] = [res[n] for n in out_names[1:]]
                if r is reference:
                    out = res
            report.steps += 1
            log(
                f"  step {report.steps}: {inputs['input_ids'].shape[0]} new tokens in "
                f"{inputs['seq_lens'].shape[0]} sequences through {len(runners)} runners"
            )
            return _to_torch(out[out_names[0]])[wanted.cpu()], [_to_torch(out[n]) for n in out_names[1:]]

        prompts, features = family.check_prompts(model, seed)
        generate(
            model,
            prompts,
            decode_steps,
            prefill_chunk=prefill_chunk,
            kv_block_size=kv_block_size,
            stop_at_eos=False,
            forward=forward,
            image_features=features,
        )
    finally:
        for r in runners:
            r.deactivate()

    run_results = RunResults()
    for r in runners:
        run_results.append((r.name, results[r.name]))
    with np.errstate(divide="ignore", invalid="ignore"):  # relative errors of integer caches at 0
        accuracy = Comparator.compare_accuracy(
            run_results, comparisons=[(0, i) for i in range(1, len(runners))], compare_func=_simple_compare(atol, rtol)
        )
    report.passed = bool(accuracy)
    for r in runners[1:]:
        per = {}
        for name in out_names:
            errs, rels, ok = [], [], True
            for got_it, want_it in zip(results[r.name], results[reference.name]):
                got = np.asarray(got_it[name]).astype(np.float64)
                want = np.asarray(want_it[name]).astype(np.float64)
                if got.shape != want.shape:
                    ok = False
                    continue
                err = np.abs(got - want)
                errs.append(err)
                rels.append(err / np.maximum(np.abs(want), 1e-12))
                ok &= bool(np.all(err <= atol + rtol * np.abs(want)))
            flat = np.concatenate([e.ravel() for e in errs]) if errs else np.zeros(1)
            rel = np.concatenate([e.ravel() for e in rels]) if rels else np.zeros(1)
            per[name] = {
                "max_abs": float(flat.max()),
                "mean_abs": float(flat.mean()),
                "max_rel": float(rel.max()),
                "passed": ok,
            }
        report.stats[r.name] = per
    if save_inputs:
        from polygraphy.json import save_json

        save_json(feeds, save_inputs, description="dash-compare per-step inputs (reference caches)")
    if save_outputs:
        ref_only = RunResults()
        ref_only.append((reference.name, results[reference.name]))
        ref_only.save(save_outputs)
    return report


class VisionRunner(_runner_base()):  # type: ignore[misc]
    """A polygraphy runner over the PyTorch vision tower (:class:`dash_trt.export.VisionGraph`)."""

    def __init__(self, graph, name: str = "pytorch"):
        super().__init__(name=name)
        self.graph = graph

    def activate_impl(self):
        pass

    def deactivate_impl(self):
        pass

    def get_input_metadata_impl(self):
        from polygraphy.common import TensorMetadata

        return TensorMetadata()

    def infer_impl(self, feed_dict):
        from .export import VISION_INPUT, VISION_OUTPUTS

        with torch.no_grad():
            out = self.graph(torch.from_numpy(np.asarray(feed_dict[VISION_INPUT])))
        return OrderedDict((n, t.numpy()) for n, t in zip(VISION_OUTPUTS, out))


#: Vision features against float32 PyTorch (the tower's sums run over thousands of terms).
VISION_TOLERANCE = (2e-3, 2e-3)


def compare_vision(onnx_path: str, checkpoint: str, *, seed: int = 0, views: int = 3, log=print) -> CompareReport:
    """A vision tower graph (``dash-export --vision``) against the checkpoint's tower in PyTorch,
    on ``views`` random views of the graph's size, through polygraphy's comparator."""
    from polygraphy.comparator import Comparator, IterationResult, RunResults

    from .export import VISION_INPUT, VISION_OUTPUTS, VisionGraph
    from .models.checkpoint import load_vision_tower

    graph = read_graph(onnx_path)
    x = next((t for t in graph.inputs if t.name == VISION_INPUT), None)
    if x is None or x.dims is None or len(x.dims) != 4 or x.dims[2] < 1:
        raise CompareError(f"{onnx_path}: not a vision graph of dash-export --vision ({VISION_INPUT} [N, 3, S, S])")
    try:
        tower = load_vision_tower(checkpoint)
    except Exception as exc:  # noqa: BLE001 - reported as bad input
        raise CompareError(f"{checkpoint}: {exc}") from None
    size = x.dims[2]
    reference = VisionRunner(VisionGraph(tower.float().eval(), size))
    runners = [reference, _onnxrt_runner(onnx_path)]
    feed = {VISION_INPUT: torch.randn(views, 3, size, size, generator=torch.Generator().manual_seed(seed)).numpy()}
    results = RunResults()
    for r in runners:
        with r:
            results.append((r.name, [IterationResult(outputs=r.infer(feed, check_inputs=False), runner_name=r.name)]))
    atol, rtol = VISION_TOLERANCE
    passed = bool(Comparator.compare_accuracy(results, comparisons=[(0, 1)], compare_func=_simple_compare(atol, rtol)))
    report = CompareReport(runners=[r.name for r in runners], steps=1, passed=passed)
    got, want = results[runners[1].name][0], results[reference.name][0]
    report.stats[runners[1].name] = {
        n: {
            "max_abs": float(np.abs(np.asarray(got[n], np.float64) - np.asarray(want[n], np.float64)).max()),
            "passed": bool(np.allclose(got[n], want[n], atol=atol, rtol=rtol)),
        }
        for n in VISION_OUTPUTS
    }
    log(f"dash-compare: {onnx_path}: {views} views of {size} px against the vision tower in PyTorch")
    return report


def _simple_compare(atol: float, rtol: float):
    """polygraphy's element-wise comparison (SimpleCompareFunc from 0.53 on)."""
    try:
        from polygraphy.comparator import SimpleCompareFunc

        return SimpleCompareFunc(atol=atol, rtol=rtol, check_shapes=True)
    except ImportError:
        from polygraphy.comparator import CompareFunc

        return CompareFunc.simple(atol=atol, rtol=rtol, check_shapes=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dash-compare",
        epilog="Exit codes: 0 every backend matches the reference, 1 a mismatch, 2 bad input (files, "
        "checkpoint, a graph that is not this checkpoint's, an unavailable backend), "
        + EXIT_CODES_NOTE
        + " To run polygraphy's own tools on the file, feed them the inputs saved here: 'polygraphy run "
        "model.onnx --onnxrt --load-inputs inputs.json' or 'polygraphy check lint model.onnx --load-inputs "
        "inputs.json' (polygraphy's random inputs are random block tables, which index outside the caches).",
        description="Compare every available backend (ONNX Runtime, the CUDA kernels, a TensorRT engine) with "
        "the PyTorch reference on chunked prefill and decode steps, using polygraphy's comparator.",
    )
    p.add_argument("--version", action="version", version=_version_line())
    p.add_argument("onnx", help="a model exported by dash-export")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--checkpoint", help="the checkpoint the file was exported from (model.pt or a Hugging Face folder)"
    )
    src.add_argument("--demo", action="store_true", help="the built-in demo model (as dash-export --demo)")
    p.add_argument(
        "--model",
        metavar="MODULE:CLASS",
        dest="model_class",
        help="the checkpoint's model class (as dash-export --model; default: its config's architecture)",
    )
    p.add_argument("--seed", type=int, default=0, help="demo model seed (dash-export --seed) and prompt seed")
    p.add_argument("--engine", help="a TensorRT engine built by dash-build")
    p.add_argument("--plugin", help="libdash_trt_plugin.so (with --engine; default: the one in this installation)")
    p.add_argument("--no-cuda", action="store_true", help="leave out the CUDA kernels runner")
    p.add_argument("--decode-steps", type=int, default=3)
    p.add_argument("--prefill-chunk", type=int, default=40)
    p.add_argument("--atol", type=float)
    p.add_argument("--rtol", type=float)
    p.add_argument("--json", help="write the per-output error report here")
    p.add_argument("--save-inputs", help="polygraphy JSON of the reference's per-step feeds")
    p.add_argument("--save-outputs", help="polygraphy RunResults JSON of the reference's outputs")
    p.add_argument("--unsafe-load", action="store_true", help="allow unpickling arbitrary objects in --checkpoint")
    p.add_argument(
        "--verbose",
        action="store_true",
        help="polygraphy's per-output, per-step comparison log, and the traceback of an unexpected error",
    )
    return p


@cli_main("dash-compare")
def main(argv: Sequence[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    from polygraphy.logger import G_LOGGER

    G_LOGGER.module_severity = G_LOGGER.INFO if a.verbose else G_LOGGER.ERROR
    if a.decode_steps < 0 or a.prefill_chunk < 1:
        _parser().error("--decode-steps must be >= 0 and --prefill-chunk >= 1")
    try:
        if not os.path.isfile(a.onnx):
            raise CompareError(f"{a.onnx}: no such file")
        for flag, path in (("--json", a.json), ("--save-inputs", a.save_inputs), ("--save-outputs", a.save_outputs)):
            folder = os.path.dirname(os.path.abspath(path)) if path else None
            if folder is not None and not os.path.isdir(folder):  # known before the run, not after it
                raise CompareError(f"{flag} {path}: folder {folder} does not exist")
        if a.demo:
            model = demo_model(seed=a.seed)
        else:
            try:
                model = load_model(a.checkpoint, allow_pickle=a.unsafe_load, model_class=a.model_class)
            except Exception as exc:  # noqa: BLE001 - reported as bad input
                raise CompareError(f"{a.checkpoint}: {exc}") from None
        if a.engine is not None and not os.path.isfile(a.engine):
            raise CompareError(f"{a.engine}: no such file")
        if _is_vision_graph(a.onnx):
            if not a.checkpoint:
                raise CompareError("a vision graph is compared with the checkpoint folder's tower: pass --checkpoint")
            report = compare_vision(a.onnx, a.checkpoint, seed=a.seed)
            return _finish(report, a)
        check_model_matches(a.onnx, model)
        print(f"dash-compare: {a.onnx} against the PyTorch reference")
        report = compare(
            a.onnx,
            model,
            engine=a.engine,
            plugin=a.plugin,
            use_cuda=not a.no_cuda,
            seed=a.seed,
            decode_steps=a.decode_steps,
            prefill_chunk=a.prefill_chunk,
            atol=a.atol,
            rtol=a.rtol,
            save_inputs=a.save_inputs,
            save_outputs=a.save_outputs,
        )
    except CompareError as exc:
        print(f"dash-compare: error: {exc}", file=sys.stderr)
        return 2
    return _finish(report, a)


def _is_vision_graph(path: str) -> bool:
    from .export import VISION_INPUT

    try:
        return any(t.name == VISION_INPUT for t in read_graph(path).inputs)
    except GraphReadError:
        return False


def _finish(report: CompareReport, a) -> int:
    for name, why in report.skipped.items():
        print(f"  {name}: not run ({why})")
    for runner, per in report.stats.items():
        worst = max(per.items(), key=lambda kv: kv[1]["max_abs"])
        bad = [n for n, s in per.items() if not s["passed"]]
        print(
            f"  {runner} vs pytorch: {len(per)} outputs x {report.steps} steps, worst {worst[0]} "
            f"max |err| {worst[1]['max_abs']:.3e}" + (f"; MISMATCH in {', '.join(bad[:6])}" if bad else "")
        )
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(report.to_json(), fh, indent=1)
    print("RESULT: " + ("all backends match the reference" if report.passed else "MISMATCH"))
    return 0 if report.passed else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
