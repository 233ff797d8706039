"""``dash-triton``: write a Triton model repository for a DASH model, and serve it.

    dash-triton write model.pt --out repo [--onnx model.onnx --plan model.plan --plugin libdash_trt_plugin_static.so]
    dash-triton write --demo --out repo          # the built-in random demo model
    dash-triton serve repo                       # the tritonserver of nvidia-pytriton, on 127.0.0.1
    dash-triton openai --url 127.0.0.1:8000      # an OpenAI-style /v1/completions endpoint in front of it
    dash-triton probe --url 127.0.0.1:8001       # liveness: does every generation model's worker answer?

Exit codes: 0 ok; 2 bad input (arguments, checkpoint, ONNX file, existing output);
3 the server could not start (``serve``), or a model did not answer (``probe``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import TextIO

from .. import triton_protocol as P
from ..attention.dash.config import DashConfigError
from ..cliutil import EXIT_CODES_NOTE, VERBOSE_HELP, cli_main
from ..documents.render import add_render_limit_arguments, render_limits_from_args
from ..modeling import ModelContractError
from ..models.checkpoint import CheckpointError
from ..models.config import ModelConfigError
from ..models.loader import load_model
from ..models.registry import demo_model
from ..serving.engine import EngineConfig, EngineConfigError
from ..versions import version_line as _version_line
from .repository import RepositoryError, onnx_kv_block_size, pool_bytes, write_repository

EXIT_OK, EXIT_BAD_INPUT, EXIT_SERVER = 0, 2, 3


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dash-triton", description="Triton Inference Server deployment of a DASH model.")
    p.add_argument("--version", action="version", version=_version_line())
    sub = p.add_subparsers(dest="command", required=True)

    w = sub.add_parser(
        "write",
        help="write a model repository",
        epilog="Exit codes: 0 written, 2 bad input (arguments, checkpoint, ONNX file, an existing output); "
        "nothing is left half-written; " + EXIT_CODES_NOTE,
        description="Write a Triton model repository: a Python-backend generation service that owns a paged KV "
        "pool (unary and streaming models), and with --plan a tensorrt_plan model of the exported "
        "graph.",
    )
    src = w.add_mutually_exclusive_group()
    src.add_argument(
        "checkpoint",
        nargs="?",
        help="model.pt ({'config': ..., 'state_dict': ...}) or a Hugging Face folder (config.json + safetensors)",
    )
    src.add_argument("--demo", action="store_true", help="the built-in random demo model")
    w.add_argument("--seed", type=int, default=0, help="seed of the demo model's random weights (with --demo)")
    w.add_argument("--out", "-o", required=True, help="repository folder to create")
    w.add_argument(
        "--force",
        action="store_true",
        help="replace --out if it is a repository dash-triton wrote and holds only what it wrote (or an empty folder)",
    )
    w.add_argument(
        "--private",
        action="store_true",
        help="make the repository readable by its owner only (0700 folders, 0600 files; default: the umask's modes, "
        "so that a server running as another user can read it)",
    )
    w.add_argument(
        "--name",
        default=P.DEFAULT_NAME,
        help="model name: NAME (unary), NAME_stream (streaming), NAME_plan (default %(default)s)",
    )
    w.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the generation models run (KIND_CPU / KIND_GPU instances)",
    )
    w.add_argument(
        "--gpus",
        help="with --device cuda: comma-separated GPU ids, one generation engine and KV pool "
        "on each (data parallel; default: every GPU the server sees)",
    )
    w.add_argument("--no-stream-model", action="store_true", help="do not write the decoupled streaming model")
    w.add_argument(
        "--no-document-model",
        action="store_true",
        help="do not write NAME_document (written when the checkpoint folder has a vision tower and a tokenizer: "
        "a PDF or image in, one text section per page out)",
    )
    w.add_argument(
        "--document-instances",
        type=int,
        default=2,
        help="CPU instances of NAME_document, each a process serving documents in parallel (%(default)s)",
    )
    add_render_limit_arguments(w, "NAME_document")
    w.add_argument("--unsafe-load", action="store_true", help="allow a pickled checkpoint (trusted files only)")
    w.add_argument(
        "--model",
        metavar="MODULE:CLASS",
        dest="model_class",
        help="the checkpoint's model class (as dash-export --model). A path/to/file.py:Class is copied "
        "into the repository; a package.module:Class must be importable by the server's Python",
    )
    e = w.add_argument_group("generation engine (per model instance)")
    d = EngineConfig()
    e.add_argument("--num-blocks", type=int, default=d.num_blocks, help="KV blocks in the pool (%(default)s)")
    e.add_argument(
        "--kv-block-size",
        type=int,
        default=None,
        help=f"tokens per KV block (default: the ONNX file's, else {d.kv_block_size})",
    )
    e.add_argument("--prefill-chunk", type=int, default=d.prefill_chunk, help="(%(default)s)")
    e.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens, help="(%(default)s)")
    e.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="(%(default)s)")
    e.add_argument(
        "--max-pages-in-flight",
        type=int,
        default=d.max_pages_in_flight,
        help="most document pages running at once, the rest wait in order (%(default)s: no limit)",
    )
    e.add_argument(
        "--max-new-tokens", type=int, default=d.default_max_new_tokens, help="default per request (%(default)s)"
    )
    e.add_argument("--max-new-tokens-limit", type=int, default=d.max_new_tokens_limit, help="(%(default)s)")
    e.add_argument("--no-warmup", action="store_true", help="skip the warm-up generation at model load")
    e.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="do not share completed document blocks between requests (docs/triton.md, Prefix caching)",
    )
    e.add_argument(
        "--no-kv-on-demand",
        action="store_true",
        help="reserve each request's worst case (prompt + max_new_tokens) of KV blocks at admission "
        "instead of allocating as it grows and preempting (by recompute) under pressure",
    )
    e.add_argument(
        "--allow-engine-control",
        action="store_true",
        help="serve engine_control requests (pause/resume the engine's model steps; any client that "
        "reaches the server can then pause it, so leave this off on shared endpoints)",
    )
    e.add_argument("--torch-threads", type=int, default=0, help="torch.set_num_threads in the model (0: default)")
    w.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    t = w.add_argument_group("TensorRT model")
    t.add_argument("--onnx", help="the exported model.onnx (inputs, outputs and dims of the plan model)")
    t.add_argument("--plan", help="TensorRT engine built from --onnx")
    t.add_argument(
        "--plugin",
        help="build/plugins/trt/libdash_trt_plugin_static.so of the plugin build the engine was "
        "built with (libdash_trt_plugin.so beside it is copied too; default: the plugin in this installation)",
    )
    t.add_argument("--plan-instances", type=int, default=1, help="instances per GPU (%(default)s)")
    t.add_argument("--plan-gpus", help="comma-separated GPU ids (default: all)")

    s = sub.add_parser(
        "serve",
        epilog="Exit codes: 0 stopped cleanly (Ctrl-C / SIGTERM, every request answered; or before the models "
        "were ready), 2 bad input (no repository, a port in use, a name Triton's launch shell would run, a "
        "non-loopback --http-address without --expose-triton-http), 3 the server could not start, a model's "
        "worker died, or the shutdown was not clean, " + EXIT_CODES_NOTE,
        help="serve a repository with the tritonserver of nvidia-pytriton (127.0.0.1)",
        description="Start the Triton server shipped in the nvidia-pytriton wheel on a repository, bound to "
        "127.0.0.1, and wait until Ctrl-C. For a production Triton, run tritonserver yourself (see "
        "the repository's README.md).",
    )
    s.add_argument("repository")
    s.add_argument("--http-port", type=_port, default=8000)
    s.add_argument(
        "--http-address",
        default="127.0.0.1",
        help="address of Triton's HTTP front end (default %(default)s; gRPC and metrics always listen on "
        "127.0.0.1); any other than a loopback address needs --expose-triton-http",
    )
    s.add_argument(
        "--expose-triton-http",
        action="store_true",
        help="allow --http-address to be a non-loopback address (e.g. for a health probe from another "
        "host); Triton's HTTP inference then needs the admin key too (docs/triton.md, What listens where)",
    )
    s.add_argument(
        "--open-http-inference",
        action="store_true",
        help="let Triton's HTTP inference API answer requests without the admin key (by default it needs the "
        "key: a crafted HTTP inference request can crash this Triton version, and gRPC, which dash-client and "
        "dash-trt ocr use without a key, refuses it); any process on the machine can then crash the server",
    )
    # HTTP inference is keyed by default now; the old opt-in stays accepted
    s.add_argument("--key-http-inference", action="store_true", help=argparse.SUPPRESS)
    s.add_argument(
        "--admin-key-file",
        metavar="PATH",
        help="write the admin key of this run (random; the restricted APIs: shared memory, model repository, "
        "statistics, trace, logging) to PATH, readable by its owner only (default: the key is not shown)",
    )
    s.add_argument("--grpc-port", type=_port, default=8001)
    s.add_argument("--metrics-port", type=_port, default=None, help="enable metrics on this port")
    s.add_argument("--log", help="server log file (default: a scratch file, shown on failure)")
    s.add_argument(
        "--verbose",
        type=int,
        default=0,
        help="tritonserver --log-verbose level (any value: also the traceback of an unexpected error)",
    )
    s.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the models to load")
    s.add_argument(
        "--grace",
        type=float,
        default=5.0,
        help="on Ctrl-C / SIGTERM, seconds the running requests may still take before they are answered "
        "UNAVAILABLE (default %(default)s)",
    )
    r = sub.add_parser(
        "probe",
        help="check that every generation model on a running server answers (a liveness probe)",
        epilog="Exit codes: 0 every generation model answered, 2 bad arguments (a missing or wrong admin key), "
        "3 the server cannot be reached, "
        "has no generation model, or one did not answer (a dead worker, a stopped engine); " + EXIT_CODES_NOTE,
        description="Send a statistics request to each generation model of a running Triton server and say "
        "which answer. Triton 2.51 keeps reporting a model ready after its worker process died (its "
        "readiness endpoint cannot see the Python backend's stub); this probe exercises the worker, "
        "so use it as the liveness check of a tritonserver that dash-triton serve does not watch "
        "(docs/triton.md, A dead model worker).",
    )
    r.add_argument("--url", default="127.0.0.1:8001", help="Triton's gRPC endpoint (%(default)s)")
    r.add_argument(
        "--model",
        action="append",
        default=[],
        help="check only this model (repeatable; default: every generation model the server has loaded)",
    )
    r.add_argument("--timeout", type=float, default=10.0, help="seconds each model has to answer (%(default)s)")
    r.add_argument("--json", action="store_true", help="print each model's statistics as one JSON object")
    r.add_argument(
        "--admin-key-file",
        metavar="PATH",
        help="the admin key that dash-triton serve --admin-key-file wrote (the list of loaded models is a "
        "restricted API)",
    )
    r.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    from ..frontdoor.cli import add_parser

    add_parser(sub)
    return p


def _port(text: str) -> int:
    """A TCP port for argparse: 1..65535 (a larger number would bind another port)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 1..65535, got {port}")
    return port


def _gpu_list(flag: str, text: str | None) -> list[int] | None:
    """``"0,1"`` as ``[0, 1]``; a RepositoryError naming ``flag`` for anything else."""
    if not text:
        return None
    try:
        return [int(g) for g in text.split(",")]
    except ValueError:
        raise RepositoryError(f"{flag} must be comma-separated GPU ids, e.g. 0,1; got {text!r}") from None


def _engine_config(a, kv_block_size: int) -> EngineConfig:
    return EngineConfig(
        num_blocks=a.num_blocks,
        kv_block_size=kv_block_size,
        prefill_chunk=a.prefill_chunk,
        max_batch_tokens=a.max_batch_tokens,
        max_num_seqs=a.max_num_seqs,
        max_pages_in_flight=a.max_pages_in_flight,
        default_max_new_tokens=a.max_new_tokens,
        max_new_tokens_limit=a.max_new_tokens_limit,
        prefix_caching=not a.no_prefix_caching,
        kv_on_demand=not a.no_kv_on_demand,
    )


def _document_folder(checkpoint: str | None) -> str | None:
    """The checkpoint folder when it has what the document model needs (a tokenizer and a
    vision tower), else None."""
    from .repository import document_sources

    return checkpoint if document_sources(checkpoint) is not None else None


def write_main(a, out: TextIO, err: TextIO) -> int:
    if not (a.checkpoint or a.demo):
        print("dash-triton write: error: give a checkpoint (model.pt or a Hugging Face folder) or --demo", file=err)
        return EXIT_BAD_INPUT
    try:
        render_limits = render_limits_from_args(a)
    except ValueError as exc:
        print(f"dash-triton write: error: {exc}", file=err)
        return EXIT_BAD_INPUT
    try:
        kv = a.kv_block_size
        if a.onnx and kv is None:
            kv = onnx_kv_block_size(a.onnx)
        engine = _engine_config(a, kv or EngineConfig().kv_block_size)
        if a.demo and a.model_class:
            raise RepositoryError("--demo is the built-in DashForCausalLM; --model goes with a checkpoint")
        model = (
            demo_model(seed=a.seed)
            if a.demo
            else load_model(a.checkpoint, allow_pickle=a.unsafe_load, model_class=a.model_class)
        )
        gpus = _gpu_list("--plan-gpus", a.plan_gpus)
        engine_gpus = _gpu_list("--gpus", a.gpus)
        # A model.pt is copied as it is; a Hugging Face folder or safetensors file (and a
        # pickled checkpoint) is written into the repository as a model.pt of the loaded model.
        copy = (
            a.checkpoint
            if a.checkpoint
            and not a.unsafe_load
            and os.path.isfile(a.checkpoint)
            and not a.checkpoint.endswith(".safetensors")
            else None
        )
        written = write_repository(
            a.out,
            model,
            checkpoint=copy,
            engine=engine,
            name=a.name,
            device=a.device,
            streaming=not a.no_stream_model,
            onnx=a.onnx,
            plan=a.plan,
            plugin=a.plugin,
            plan_instances=a.plan_instances,
            plan_gpus=gpus,
            warmup=not a.no_warmup,
            torch_num_threads=a.torch_threads,
            allow_engine_control=a.allow_engine_control,
            force=a.force,
            gpus=engine_gpus,
            documents=None if a.no_document_model else _document_folder(a.checkpoint),
            document_instances=a.document_instances,
            render_limits=render_limits,
            private=a.private,
        )
    except (
        RepositoryError,
        EngineConfigError,
        CheckpointError,
        ModelConfigError,
        DashConfigError,
        ModelContractError,
    ) as exc:
        print(f"dash-triton write: error: {exc}", file=err)
        return EXIT_BAD_INPUT
    except (OSError, ValueError) as exc:
        print(f"dash-triton write: error: {type(exc).__name__}: {exc}", file=err)
        return EXIT_BAD_INPUT
    for m in written.messages:
        print(f"note: {m}", file=err)
    print(
        f"wrote {written.path}: models {', '.join(written.models)}; KV pool per generation model "
        f"{engine.num_blocks} blocks x {engine.kv_block_size} tokens ({pool_bytes(model, engine) / 2**20:.1f} MiB)",
        file=out,
    )
    print(f"serve it: dash-triton serve {written.path}", file=out)
    return EXIT_OK


def _exit_status(code: int | None) -> str:
    """A process's exit status as a user reads it: ``code 1`` or ``killed by SIGABRT``."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"code {code}"


def serve_main(a, out: TextIO, err: TextIO) -> int:
    from .server import (
        TritonPortInUse,
        TritonServer,
        TritonStartCancelled,
        TritonStartError,
        TritonUnavailable,
        is_loopback,
        process_info,
        write_admin_key,
    )

    exposed = not is_loopback(a.http_address)
    if a.open_http_inference and (exposed or a.key_http_inference):
        print(
            "dash-triton serve: error: --open-http-inference leaves Triton's HTTP inference unkeyed, which "
            + ("a non-loopback --http-address does not allow" if exposed else "--key-http-inference contradicts"),
            file=err,
        )
        return EXIT_BAD_INPUT
    if exposed and not a.expose_triton_http:
        print(
            f"dash-triton serve: error: --http-address {a.http_address} is not a loopback address: Triton's HTTP "
            "front end is not meant to face untrusted clients (one crafted request can crash this Triton version); "
            "serve clients through dash-triton openai, or pass --expose-triton-http to do it anyway",
            file=err,
        )
        return EXIT_BAD_INPUT
    try:
        server = TritonServer(
            a.repository,
            http_port=a.http_port,
            grpc_port=a.grpc_port,
            metrics_port=a.metrics_port,
            log_path=a.log,
            verbose=a.verbose,
            http_address=a.http_address,
            key_http_inference=not a.open_http_inference,
        )
    except (FileNotFoundError, RepositoryError) as exc:  # RepositoryError: a name unsafe for Triton's launch shell
        print(f"dash-triton serve: error: {exc}", file=err)
        return EXIT_BAD_INPUT
    except TritonUnavailable as exc:
        print(f"dash-triton serve: error: {exc}", file=err)
        return EXIT_SERVER
    if a.admin_key_file:
        try:
            write_admin_key(a.admin_key_file, server.admin_key)
        except OSError as exc:
            server.cleanup()
            print(f"dash-triton serve: error: --admin-key-file: {exc}", file=err)
            return EXIT_BAD_INPUT
    if exposed:
        print(
            f"dash-triton serve: warning: Triton's HTTP front end listens on {a.http_address} (--expose-triton-http); "
            "its inference API needs the admin key",
            file=err,
            flush=True,
        )
    print(f"starting tritonserver (log {server.log_path}) ...", file=err, flush=True)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            server.start(timeout=a.timeout, cancel=stop)
        except TritonStartCancelled:
            print("stopped before the models were ready (the server was killed: nothing was served yet)", file=err)
            return EXIT_OK
        except TritonPortInUse as exc:
            print(f"dash-triton serve: error: {exc}", file=err)
            return EXIT_BAD_INPUT
        except TritonStartError as exc:
            print(f"dash-triton serve: error: {exc}", file=err)
            return EXIT_SERVER
        print(
            f"ready: HTTP {server.http_url}, gRPC {server.grpc_url}"
            + (f", metrics 127.0.0.1:{server.metrics_port}" if server.metrics_port else "")
            + "; Ctrl-C stops",
            file=out,
            flush=True,
        )
        # The models' workers (Python-backend stubs): when one dies, Triton keeps reporting the
        # model ready while failing every request, so serve stops and exits non-zero instead
        # (a supervisor then restarts it with a fresh server).
        workers = server.workers()
        while not stop.wait(0.5):
            gone = {pid: m for pid, m in workers.items() if process_info(pid) is None}
            if not server.alive():
                # Triton 2.51's Python backend can abort the whole server (an uncaught exception
                # in its stub-health thread) within moments of a stub's death, so both may be
                # seen gone in one poll: the worker is named then too.
                died = "".join(
                    f"a model worker died (pid {pid}, {where or 'a model'}) and " for pid, where in gone.items()
                )
                print(
                    f"dash-triton serve: error: {died}tritonserver exited ({_exit_status(server.returncode)}):\n"
                    f"{server.log_tail()}",
                    file=err,
                )
                return EXIT_SERVER
            if gone:
                pid, where = next(iter(gone.items()))
                print(
                    f"dash-triton serve: error: a model worker died (pid {pid}, {where or 'a model'}): its model "
                    f"cannot answer any more; stopping the server (exit {EXIT_SERVER}) so that a supervisor can "
                    f"start a fresh one",
                    file=err,
                    flush=True,
                )
                # The other models drain as on Ctrl-C; then the server is killed rather than
                # stopped: Triton would wait for the requests the dead worker holds, which it
                # never answers, and killing it answers their clients UNAVAILABLE at once.
                if len(gone) < len(workers):
                    _, notes = server.drain(grace=a.grace)
                    for note in notes:
                        print(f"dash-triton serve: {note}", file=err, flush=True)
                server.stop(kill=True)
                return EXIT_SERVER
        # Graceful: the models answer what they hold while the server still serves, then
        # the server stops (Triton then has nothing in flight and exits at once).
        print(
            f"stopping: new requests refused, queued ones answered UNAVAILABLE, running ones given {a.grace:g} s ...",
            file=err,
            flush=True,
        )
        drained, notes = server.drain(grace=a.grace)
        for note in notes:
            print(f"dash-triton serve: {note}", file=err, flush=True)
        code = server.stop()
        if not drained or code not in (0, None):
            print(
                f"dash-triton serve: error: the shutdown was not clean (tritonserver exit code {code})",
                file=err,
                flush=True,
            )
            return EXIT_SERVER
        print("stopped", file=err, flush=True)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.cleanup()
        left = server.leftovers
        if left["workers"] or left["shm"]:
            print(
                f"dash-triton serve: cleaned up after the server: {len(left['workers'])} orphaned model worker(s) "
                f"stopped, {len(left['shm'])} shared-memory region(s) removed",
                file=err,
                flush=True,
            )
    return EXIT_OK


def probe_main(a, out: TextIO, err: TextIO) -> int:
    """``dash-triton probe``: a statistics request to each generation model; exit 0 when all
    answer (and their engines run), 3 otherwise, with one line per model."""
    import json

    from .server import admin_headers, read_admin_key, served_generation_models

    if not a.timeout > 0:
        print(f"dash-triton probe: error: --timeout must be > 0, got {a.timeout:g}", file=err)
        return EXIT_BAD_INPUT
    try:
        import tritonclient.grpc as grpcclient
    except ImportError:
        print("dash-triton probe: error: tritonclient is not installed (pip install 'dash-trt[triton]')", file=err)
        return EXIT_BAD_INPUT
    try:
        client = grpcclient.InferenceServerClient(a.url)
    except Exception as exc:  # noqa: BLE001 - a malformed URL
        print(f"dash-triton probe: error: {a.url}: {type(exc).__name__}: {exc}", file=err)
        return EXIT_BAD_INPUT
    try:
        headers = admin_headers(read_admin_key(a.admin_key_file)) if a.admin_key_file else None
    except (OSError, ValueError) as exc:
        print(f"dash-triton probe: error: --admin-key-file: {exc}", file=err)
        return EXIT_BAD_INPUT
    with client:
        try:
            served = served_generation_models(client, headers)
        except Exception as exc:  # noqa: BLE001 - no server there
            if "restricted" in str(exc):
                print(
                    f"dash-triton probe: error: the server at {a.url} lists its models only with its admin key: "
                    "give the file dash-triton serve --admin-key-file wrote",
                    file=err,
                )
                return EXIT_BAD_INPUT
            print(f"dash-triton probe: error: no Triton server at {a.url}: {_status_line(exc)}", file=err)
            return EXIT_SERVER
        models = {m: served.get(m) for m in a.model} if a.model else served
        if not models:
            print(f"dash-triton probe: error: the server at {a.url} has no generation model loaded", file=err)
            return EXIT_SERVER
        failed, report = 0, {}
        for name, decoupled in models.items():
            if decoupled is None:
                failed += 1
                print(
                    f"FAIL {name}: not a generation model the server has loaded (loaded: "
                    f"{', '.join(served) or 'none'})",
                    file=out,
                    flush=True,
                )
                continue
            try:
                stats = _probe_model(grpcclient, a.url, name, decoupled, a.timeout)
            except Exception as exc:  # noqa: BLE001 - the answer the probe exists for
                failed += 1
                print(f"FAIL {name}: {_status_line(exc)}", file=out, flush=True)
                continue
            report[name] = stats
            if stats.get("engine_alive") is False or stats.get("closed"):
                failed += 1
                print(
                    f"FAIL {name}: its generation engine is "
                    f"{'closed (shutting down)' if stats.get('closed') else 'not running'}",
                    file=out,
                    flush=True,
                )
            elif not a.json:
                print(
                    f"ok {name}: {stats.get('running', 0)} running, {stats.get('waiting', 0)} waiting, KV blocks "
                    f"{stats.get('kv_blocks_free', '?')} of {stats.get('kv_blocks_total', '?')} free"
                    + (", paused" if stats.get("paused") else ""),
                    file=out,
                    flush=True,
                )
        if a.json:
            print(json.dumps(report), file=out, flush=True)
    return EXIT_SERVER if failed else EXIT_OK


def _probe_model(grpcclient, url: str, name: str, decoupled: bool, timeout: float) -> dict:
    """One model's statistics over a connection of its own, so that a sibling whose failure
    breaks its stream or channel cannot fail this one; a transport error (UNAVAILABLE: the
    connection dropped) is tried once more on a new connection before it counts. Raises what
    the last try raised."""
    from .server import stats_request

    try:
        with grpcclient.InferenceServerClient(url) as client:
            return stats_request(client, name, decoupled, timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - re-raised unless the connection dropped
        status = exc.status() if callable(getattr(exc, "status", None)) else None
        if "UNAVAILABLE" not in str(status):
            raise
    with grpcclient.InferenceServerClient(url) as client:
        return stats_request(client, name, decoupled, timeout=timeout)


def _status_line(exc: BaseException) -> str:
    """A gRPC error as one line: its status and message (tritonclient's InferenceServerException
    carries both)."""
    status = getattr(exc, "status", None)
    status = status() if callable(status) else status
    message = getattr(exc, "message", None)
    message = message() if callable(message) else message
    text = " ".join(str(message or exc).split())
    return f"{status}: {text}" if status else f"{type(exc).__name__}: {text}"


@cli_main("dash-triton")
def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    a = _parser().parse_args(argv)
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    if a.command == "write":
        return write_main(a, out, err)
    if a.command == "probe":
        return probe_main(a, out, err)
    if a.command == "openai":
        from ..frontdoor.cli import openai_main

        return openai_main(a, out, err)
    if not os.path.isdir(a.repository):
        print(f"dash-triton serve: error: model repository not found: {a.repository}", file=err)
        return EXIT_BAD_INPUT
    return serve_main(a, out, err)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
