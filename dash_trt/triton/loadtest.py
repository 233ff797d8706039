"""Load test of the generation service: many concurrent requests of mixed lengths
through gRPC, every answer compared with offline greedy generation
(:func:`dash_trt.model.generate`) of the same checkpoint, and the KV pool checked to
be fully free afterwards.

    python3 -m dash_trt.triton.loadtest --requests 32            # starts its own server (demo model)
    python3 -m dash_trt.triton.loadtest --url 127.0.0.1:8001 --checkpoint model.pt
    python3 -m dash_trt.triton.loadtest --device cuda --random-init config.json --requests 32 \
        --pages 2,8 --images 600,1400 --kv-block-size 64     # a GPU server, long documents

Prints requests/s, generated tokens/s and latency percentiles (from sending a request
to its answer); exits 1 if any answer is wrong, missing or an error, or blocks stay in use.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

import torch

from ..cliutil import EXIT_CODES_NOTE, VERBOSE_HELP, cli_main
from ..modeling import DashModel
from ..models.checkpoint import load_checkpoint
from ..models.config import DashModelConfig
from ..models.prompts import document_prompt
from ..models.registry import demo_model
from ..serving.engine import EngineConfig
from ..serving.generate import generate
from ..versions import version_line as _version_line
from .client import DashClient, DashClientError, Generation

__all__ = ["LoadCase", "LoadReport", "make_cases", "expected_tokens", "run_load", "main"]

QUESTIONS = (
    "",
    "Title?",
    "What is on page 2?",
    "Summarise the table.",
    "Who signed it?",
    "List every date mentioned in the document.",
)


@dataclass(frozen=True)
class LoadCase:
    ids: tuple[int, ...]
    max_new_tokens: int


def make_cases(
    config: DashModelConfig,
    n: int,
    seed: int = 0,
    *,
    pages: tuple[int, int] = (1, 4),
    images: tuple[int, int] = (4, 48),
    max_new_tokens: tuple[int, int] = (1, 8),
) -> list[LoadCase]:
    """``n`` document prompts of mixed lengths (pages, image tokens per page, question)
    and mixed ``max_new_tokens``, reproducible from ``seed``."""
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        per_page = [rng.randint(*images) for _ in range(rng.randint(*pages))]
        ids = document_prompt(per_page, rng.choice(QUESTIONS), config, preamble=rng.choice(("", "Doc: ")))
        cases.append(LoadCase(tuple(ids), rng.randint(*max_new_tokens)))
    return cases


def expected_tokens(model: DashModel, cases: Sequence[LoadCase], *, kv_block_size: int = 16) -> list[list[int]]:
    """Offline greedy generation of every case, one :func:`~dash_trt.model.generate` call each.

    Runs torch single-threaded: on a small, shared CPU machine the intra-op thread pool
    made these small steps several times slower (measured), and the results are the
    same."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [generate(model, [list(c.ids)], c.max_new_tokens, kv_block_size=kv_block_size).tokens[0] for c in cases]
    finally:
        torch.set_num_threads(threads)


@dataclass
class LoadReport:
    requests: int
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    correct: int = 0
    wrong: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    missing: int = 0
    tokens: int = 0
    prompt_tokens: int = 0
    stats_after: dict = field(default_factory=dict)

    @property
    def pool_free(self) -> bool:
        s = self.stats_after
        return (
            bool(s)
            and s.get("kv_blocks_free") == s.get("kv_blocks_total")
            and not s.get("running")
            and not s.get("waiting")
        )

    @property
    def ok(self) -> bool:
        return (
            self.correct == self.requests and not self.wrong and not self.errors and not self.missing and self.pool_free
        )

    def percentile(self, q: float) -> float:
        xs = sorted(self.latencies)
        if not xs:
            return float("nan")
        k = (len(xs) - 1) * q / 100
        lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    def summary(self) -> str:
        rps = self.requests / self.seconds if self.seconds else 0.0
        s = self.stats_after
        lines = [
            f"requests: {self.requests} concurrent, {self.prompt_tokens} prompt tokens, {self.tokens} generated tokens",
            f"answered: {self.correct} correct, {len(self.wrong)} wrong, {len(self.errors)} errors, "
            f"{self.missing} missing",
            f"wall time: {self.seconds:.2f} s -> {rps:.2f} requests/s, {self.tokens / max(self.seconds, 1e-9):.1f} "
            f"generated tokens/s",
            f"latency (send -> answer): p50 {self.percentile(50):.2f} s, p90 {self.percentile(90):.2f} s, "
            f"p99 {self.percentile(99):.2f} s, max {max(self.latencies, default=float('nan')):.2f} s",
            f"engine: {s.get('steps')} steps, peak {s.get('peak_running')} running / {s.get('peak_waiting')} waiting, "
            f"{s.get('waited')} requests waited for KV blocks, peak {s.get('peak_blocks_in_use')} of "
            f"{s.get('kv_blocks_total')} blocks in use",
            f"KV pool afterwards: {s.get('kv_blocks_free')} of {s.get('kv_blocks_total')} blocks free, "
            f"{s.get('running')} running, {s.get('waiting')} waiting -> "
            + ("fully free" if self.pool_free else "NOT FREE"),
        ]
        return "\n".join(lines)


def run_load(
    client: DashClient,
    cases: Sequence[LoadCase],
    expected: Sequence[Sequence[int]] | None = None,
    *,
    timeout: float = 600.0,
) -> LoadReport:
    """Send every case at once (gRPC async) and wait for all answers."""
    if client.protocol != "grpc":
        raise ValueError("run_load needs a gRPC DashClient (async requests with completion callbacks)")
    n = len(cases)
    results: list[Generation | DashClientError | None] = [None] * n
    left = threading.Semaphore(0)

    def callback(i):
        def done(res):
            results[i] = res
            left.release()

        return done

    t0 = time.perf_counter()
    for i, c in enumerate(cases):
        client.generate_async(c.ids, c.max_new_tokens, callback(i))
    deadline = t0 + timeout
    got = 0
    while got < n and left.acquire(timeout=max(0.0, deadline - time.perf_counter())):
        got += 1
    report = LoadReport(n, seconds=time.perf_counter() - t0, prompt_tokens=sum(len(c.ids) for c in cases))
    for i, res in enumerate(results):
        if res is None:
            report.missing += 1
        elif isinstance(res, DashClientError):
            report.errors.append(f"request {i}: {res}")
        else:
            report.latencies.append(res.seconds)
            report.tokens += len(res.tokens)
            if expected is None or list(res.tokens) == list(expected[i]):
                report.correct += 1
            else:
                report.wrong.append(i)
    report.stats_after = client.stats()
    return report


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python3 -m dash_trt.triton.loadtest",
        description=__doc__.split("\n\n")[0],
        epilog="Exit codes: 0 every request answered correctly and the pool free, 1 not "
        "(wrong, failed or missing answers, blocks held), 2 bad input, 3 the server "
        "could not start or be reached, " + EXIT_CODES_NOTE,
    )
    p.add_argument("--version", action="version", version=_version_line())
    p.add_argument("--url", help="gRPC host:port of a running server (default: start one on a demo repository)")
    p.add_argument(
        "--checkpoint", help="model.pt or Hugging Face folder the server runs (default: the built-in demo model)"
    )
    p.add_argument(
        "--random-init",
        metavar="CONFIG_JSON",
        help="a model of this config.json with random weights (seed --demo-seed) instead of the demo model",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "float16", "bfloat16"),
        default=None,
        help="dtype of the --random-init model (default: its config's)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the server it starts runs the model (KIND_GPU for cuda); the offline generation "
        "that checks the answers runs there too",
    )
    p.add_argument(
        "--demo-seed",
        type=int,
        default=2,
        help="seed of the demo model's random weights (default 2: its greedy outputs vary from prompt "
        "to prompt, so a wrong answer shows)",
    )
    p.add_argument("--model", default="dash")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pages", default="1,4", help="min,max pages per prompt")
    p.add_argument("--images", default="4,48", help="min,max image tokens per page")
    p.add_argument("--max-new-tokens", default="1,8", help="min,max new tokens per request")
    p.add_argument("--num-blocks", type=int, default=512, help="KV pool of the server it starts")
    p.add_argument("--kv-block-size", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=EngineConfig.prefill_chunk)
    p.add_argument("--max-batch-tokens", type=int, default=EngineConfig.max_batch_tokens)
    p.add_argument(
        "--model-class",
        metavar="MODULE:CLASS",
        dest="model_class",
        help="the model class of --checkpoint / --random-init (dash-export's --model; --model here is "
        "the Triton model's name)",
    )
    p.add_argument("--no-check", action="store_true", help="skip the offline generation (no correctness check)")
    p.add_argument("--server-log", help="the started server's log file (default: a scratch file)")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds to wait for the models to load")
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    return p


def _pair(text: str) -> tuple[int, int]:
    a, b = (int(x) for x in text.split(","))
    return a, b


@cli_main("dash-loadtest")
def main(argv: Sequence[str] | None = None, *, stdout: TextIO | None = None) -> int:
    a = _parser().parse_args(argv)
    out = stdout or sys.stdout
    from ..attention.dash.config import DashConfigError
    from ..modeling import ModelContractError
    from ..models.checkpoint import CheckpointError
    from ..models.config import ModelConfigError
    from .client import DashClientError
    from .server import TritonStartError, TritonUnavailable

    try:
        return _run(a, out)
    except (CheckpointError, ModelConfigError, ModelContractError, DashConfigError, ValueError) as exc:
        print(f"loadtest: error: {exc}", file=sys.stderr)
        return 2
    except (TritonStartError, TritonUnavailable, DashClientError) as exc:
        print(f"loadtest: error: {exc}", file=sys.stderr)
        return 3


def _run(a, out: TextIO) -> int:
    if a.checkpoint:
        model = load_checkpoint(a.checkpoint, model_class=a.model_class)
    elif a.random_init:
        from ..models.config import DTYPES, load_model_config
        from ..models.registry import random_model

        model = random_model(
            load_model_config(a.random_init),
            seed=a.demo_seed,
            dtype=DTYPES[a.dtype] if a.dtype else None,
            model_class=a.model_class,
        )
    else:
        model = demo_model(seed=a.demo_seed)
    if a.device == "cuda":
        model = model.cuda()
    cases = make_cases(
        model.config,
        a.requests,
        a.seed,
        pages=_pair(a.pages),
        images=_pair(a.images),
        max_new_tokens=_pair(a.max_new_tokens),
    )
    expected = None
    if not a.no_check:
        t = time.perf_counter()
        expected = expected_tokens(model, cases, kv_block_size=a.kv_block_size)
        print(
            f"offline greedy generation (dash_trt.model.generate) of {len(cases)} prompts: "
            f"{time.perf_counter() - t:.1f} s",
            file=out,
            flush=True,
        )
    server = scratch = None
    try:
        url = a.url
        if url is None:
            from .repository import write_repository
            from .server import TritonServer

            scratch = tempfile.mkdtemp(prefix="dash-loadtest-")
            repo = os.path.join(scratch, "repo")
            engine = EngineConfig(
                num_blocks=a.num_blocks,
                kv_block_size=a.kv_block_size,
                prefill_chunk=a.prefill_chunk,
                max_batch_tokens=a.max_batch_tokens,
                max_num_seqs=max(a.requests, 1),
                default_max_new_tokens=_pair(a.max_new_tokens)[1],
                max_new_tokens_limit=max(_pair(a.max_new_tokens)[1], 1),
            )
            write_repository(repo, model, engine=engine, streaming=False, device=a.device)
            t = time.perf_counter()
            server = TritonServer(repo, log_path=a.server_log).start(timeout=a.start_timeout)
            print(
                f"tritonserver ready in {time.perf_counter() - t:.1f} s at {server.grpc_url} (KV pool "
                f"{a.num_blocks} x {a.kv_block_size}, model on {a.device})",
                file=out,
                flush=True,
            )
            url = server.grpc_url
        with DashClient(url, protocol="grpc", model=a.model) as client:
            report = run_load(client, cases, expected)
    finally:
        if server is not None:
            server.cleanup()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    print(report.summary(), file=out)
    for e in report.errors[:5]:
        print(f"  {e}", file=out)
    if report.wrong:
        print(f"  wrong answers for requests {report.wrong[:10]}", file=out)
    print("RESULT: " + ("every request answered correctly, KV pool fully free" if report.ok else "FAILED"), file=out)
    return 0 if report.ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
