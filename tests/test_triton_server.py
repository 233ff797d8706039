"""A real Triton Inference Server (the tritonserver binary of nvidia-pytriton, on CPU,
127.0.0.1, random free ports) serving the repository that dash-triton writes: the client
gets exactly the tokens of offline greedy generation over HTTP, gRPC and gRPC streaming;
32 concurrent requests of mixed lengths are all answered correctly with the KV pool
free afterwards; bad requests get clear errors while the others are served.

Marked ``triton``: deselect with ``-m 'not triton'``. Skipped with the reason when the
server cannot run on the machine; with ``DASH_REQUIRE_TRITON=1`` (set by ``.ci/run``)
that is a failure instead.
"""

import contextlib
import json
import os
import re
import threading
import time

import numpy as np
import pytest
import torch
from conftest import running_triton, triton_unavailable

from dash_trt import model as M
from dash_trt import triton_protocol as P
from dash_trt.serving.engine import EngineConfig
from dash_trt.triton import client as C
from dash_trt.triton.loadtest import expected_tokens, make_cases, run_load
from dash_trt.triton.repository import write_repository

pytestmark = pytest.mark.triton

#: Weights seed of the served demo model (greedy outputs vary from prompt to prompt).
WEIGHTS_SEED = 2
#: A small pool (64 blocks of 16 tokens) so that the load test's requests must wait.
ENGINE = EngineConfig(
    num_blocks=64,
    kv_block_size=16,
    prefill_chunk=48,
    max_batch_tokens=256,
    default_max_new_tokens=5,
    max_new_tokens_limit=64,
)


_unavailable = triton_unavailable


@pytest.fixture(scope="module")
def model():
    return M.demo_model(seed=WEIGHTS_SEED)


@pytest.fixture(scope="module")
def server(tmp_path_factory, model):
    root = tmp_path_factory.mktemp("triton")
    ckpt = root / "model.pt"
    M.save_checkpoint(model, ckpt)
    write_repository(root / "repo", model, checkpoint=str(ckpt), engine=ENGINE, allow_engine_control=True)
    # HTTP inference behind the admin key (serve --key-http-inference): the HTTP clients send it
    with running_triton(root / "repo", root / "tritonserver.log", metrics_port=0, key_http_inference=True) as srv:
        yield srv


@pytest.fixture
def http(server):
    with C.DashClient(server.http_url, protocol="http", admin_key=server.admin_key) as c:
        yield c


@pytest.fixture
def admin_key_file(server, tmp_path):
    from dash_trt.triton.server import write_admin_key

    path = tmp_path / "admin.key"
    write_admin_key(str(path), server.admin_key)
    return str(path)


@pytest.fixture
def grpc(server):
    with C.DashClient(server.grpc_url, protocol="grpc") as c:
        yield c


def offline(model, prompts, max_new):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return [M.generate(model, [p], n).tokens[0] for p, n in zip(prompts, max_new)]
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts(model):
    cfg = model.config
    return [
        M.document_prompt([20, 9, 14], "Read page 2.", cfg, preamble="Doc "),
        M.document_prompt([30], "Title?", cfg),
        M.document_prompt([5, 5, 5, 5], "", cfg),
    ]


MAX_NEW = [8, 4, 6]


@pytest.fixture(scope="module")
def want(model, prompts):
    return offline(model, prompts, MAX_NEW)


def test_http_and_grpc_give_offline_tokens(http, grpc, model, prompts, want):
    assert http.model_config() == model.config  # read from the server's config.pbtxt
    for client in (http, grpc):
        got = [client.generate(p, n) for p, n in zip(prompts, MAX_NEW)]
        assert [g.tokens for g in got] == want
        assert [g.prompt_tokens for g in got] == [len(p) for p in prompts]
        assert got[0].text == M.detokenize(want[0], model.config)
    # text prompts are tokenized with the model's own tokenizer
    text = "Doc <PAGE><image*20><PAGE><image*9><PAGE><image*14>Read page 2."
    assert http.encode(text) == prompts[0]
    assert http.generate(text, MAX_NEW[0]).tokens == want[0]
    # the model's default max_new_tokens (5), and generation past EOS
    assert len(grpc.generate(prompts[1], stop_at_eos=False).tokens) == ENGINE.default_max_new_tokens
    assert grpc.stats()["kv_blocks_free"] == ENGINE.num_blocks


def test_streaming_reports_progress_and_tokens(grpc, model):
    prompt = M.document_prompt([40, 40, 30], "Which page has the table?", model.config)
    [expect] = offline(model, [prompt], [6])
    progress, tokens = [], []
    got = grpc.stream(prompt, 6, on_progress=lambda done, total: progress.append((done, total)), on_token=tokens.append)
    assert got.tokens == tokens == expect
    # chunked prefill of 48 tokens reported chunk by chunk, ending at the prompt length
    dones = [d for d, _ in progress]
    assert len(dones) == -(-len(prompt) // ENGINE.prefill_chunk) and dones == sorted(dones)
    assert dones[-1] == len(prompt) and all(t == len(prompt) for _, t in progress)


def test_client_command(server, model, prompts, want, admin_key_file, capsys):
    text = "Doc <PAGE><image*20><PAGE><image*9><PAGE><image*14>Read page 2."
    # this server's HTTP inference needs the admin key: refused without it, with a hint
    assert C.main(["--url", server.http_url, "--protocol", "http", "--prompt", text]) == 1
    assert "expecting header 'dash-admin-key' (the server wants its admin key" in capsys.readouterr().err
    url = server.http_url

    def main(argv):  # dash-client over HTTP, with the key
        return C.main([*argv, "--protocol", "http", "--admin-key-file", admin_key_file])

    assert main(["--url", url, "--prompt", text, "--max-new-tokens", str(MAX_NEW[0])]) == 0
    out, err = capsys.readouterr()
    assert f"tokens: {' '.join(map(str, want[0]))}" in out
    assert f"prompt: {len(prompts[0])} tokens, 3 page(s)" in err
    # --pages builds the same prompt as document_prompt; --json for scripts
    assert main(["--url", url, "--pages", "30", "--question", "Title?", "--max-new-tokens", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == want[1]
    # gRPC streaming shows prefill progress on a long prompt and the tokens as they come (a
    # document of its own: one another test sent would come from the prefix cache)
    assert (
        C.main(
            [
                "--url",
                server.grpc_url,
                "--stream",
                "--pages",
                "60,60,60",
                "--preamble",
                "Streamed: ",
                "--max-new-tokens",
                "3",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert "prefill 48/193 tokens (24%)" in err and "prefill 193/193 tokens (100%)" in err
    assert out.startswith("tokens: ")
    # a long unary prompt prints progress lines while it waits
    assert main(["--url", url, "--pages", "60,60,60", "--max-new-tokens", "2", "--progress-threshold", "10"]) == 0
    assert "waiting for the answer to a 183-token prompt" in capsys.readouterr().err
    assert main(["--url", url, "--stats", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_blocks_total"] == ENGINE.num_blocks
    # a refused request: exit 1 with the server's message
    assert main(["--url", url, "--prompt", "no pages here"]) == 1
    assert "no image token" in capsys.readouterr().err
    # no server there: exit 3
    from dash_trt.triton.server import free_ports

    assert C.main(["--url", f"127.0.0.1:{free_ports(1)[0]}", "--prompt", "<PAGE><image>", "--timeout", "5"]) == 3
    assert "no Triton server" in capsys.readouterr().err


def _raw_infer(server, protocol, arrays):
    """Send arbitrary tensors (wrong dtypes and shapes included) with plain tritonclient."""
    from dash_trt.triton.server import admin_key_plugin

    mod = C._module(protocol)
    url = server.http_url if protocol == "http" else server.grpc_url
    client = mod.InferenceServerClient(url)
    client.register_plugin(admin_key_plugin(server.admin_key))  # HTTP inference needs it on this server
    try:
        inputs = []
        for name, (arr, dtype) in arrays.items():
            x = mod.InferInput(name, list(arr.shape), dtype)
            x.set_data_from_numpy(arr)
            inputs.append(x)
        return client.infer("dash", inputs)
    finally:
        client.close()


def _bad_requests(cfg, good):
    """Malformed requests (protocol, tensors, expected status, message fragment): the model's
    own checks and Triton's checks against config.pbtxt. ``good`` is a valid prompt."""
    ids = np.array(good, dtype=np.int64)
    page, image = cfg.page_token_id, cfg.image_token_id
    return [
        # (protocol, tensors, expected status, message fragment)
        (
            "http",
            {P.INPUT_IDS: (np.array(M.tokenize("What is the title?", cfg), dtype=np.int64), "INT64")},
            "400",
            "no image token",
        ),
        (
            "grpc",
            {P.INPUT_IDS: (np.array([image, 65, 66], dtype=np.int64), "INT64")},
            "StatusCode.INVALID_ARGUMENT",
            "no <PAGE> marker before its image tokens",
        ),
        (
            "http",
            {P.INPUT_IDS: (np.array([page] + [image] * 1100, dtype=np.int64), "INT64")},
            "400",
            "too long for the KV pool: a prompt of 1101 tokens plus up to 5 new tokens needs 70 KV blocks",
        ),
        (
            "http",
            {P.INPUT_IDS: (ids, "INT64"), P.MAX_NEW_TOKENS: (np.array([100], dtype=np.int32), "INT32")},
            "400",
            "max_new_tokens must be 1..64",
        ),
        ("http", {P.INPUT_IDS: (np.zeros(0, dtype=np.int64), "INT64")}, "400", "input_ids is empty"),
        (
            "http",
            {P.INPUT_IDS: (np.array([page, image, 999], dtype=np.int64), "INT64")},
            "400",
            "outside the vocabulary",
        ),
        # wrong dtype and shape: Triton itself checks them against config.pbtxt
        (
            "http",
            {P.INPUT_IDS: (ids.astype(np.int32), "INT32")},
            "400",
            "input 'input_ids' data-type is 'INT32', but model 'dash' expects 'INT64'",
        ),
        (
            "grpc",
            {P.INPUT_IDS: (ids.astype(np.float32), "FP32")},
            "StatusCode.INVALID_ARGUMENT",
            "data-type is 'FP32', but model 'dash' expects 'INT64'",
        ),
        (
            "http",
            {P.INPUT_IDS: (ids.reshape(1, -1), "INT64")},
            "400",
            "unexpected shape for input 'input_ids' for model 'dash'. Expected [-1], got [1,",
        ),
        (
            "http",
            {P.INPUT_IDS: (ids, "INT64"), P.MAX_NEW_TOKENS: (np.array([[1, 2]], dtype=np.int32), "INT32")},
            "400",
            "unexpected shape for input 'max_new_tokens'",
        ),
        ("http", {P.MAX_NEW_TOKENS: (np.array([3], dtype=np.int32), "INT32")}, "400", "input_ids"),
        (
            "http",
            {P.INPUT_IDS: (ids, "INT64"), P.SAMPLING_INPUTS["top_p"][0]: (np.array([2.0], dtype=np.float32), "FP32")},
            "400",
            "top_p must be in (0, 1]",
        ),
        (
            "grpc",
            {P.INPUT_IDS: (ids, "INT64"), P.STOP_TOKEN_IDS: (np.array([999], dtype=np.int64), "INT64")},
            "StatusCode.INVALID_ARGUMENT",
            "stop_token_ids must be token ids",
        ),
    ]


def test_bad_requests_get_errors_while_others_are_served(server, grpc, model, prompts, want):
    cfg = model.config
    # a good request in flight during all the bad ones
    box, arrived = {}, threading.Event()

    def keep(result):
        box["r"] = result
        arrived.set()

    grpc.generate_async(prompts[0], MAX_NEW[0], keep)
    bad = _bad_requests(cfg, prompts[1])
    from tritonclient.utils import InferenceServerException

    for protocol, arrays, status, fragment in bad:
        with pytest.raises(InferenceServerException) as e:
            _raw_infer(server, protocol, arrays)
        assert fragment in e.value.message(), (protocol, e.value.message())
        assert str(e.value.status()) == status, (protocol, fragment, e.value.status())
    with pytest.raises(C.DashClientError, match="no <PAGE> marker before its image tokens") as e:
        grpc.generate("<image> without a page marker, then text")
    assert e.value.status == "StatusCode.INVALID_ARGUMENT"
    # the server kept serving: the request in flight and new ones are answered correctly
    assert arrived.wait(120) and box["r"].tokens == want[0]
    assert grpc.generate(prompts[2], MAX_NEW[2]).tokens == want[2]
    stats = grpc.stats()
    assert stats["refused"] >= 9 and stats["kv_blocks_free"] == ENGINE.num_blocks


def test_load_32_concurrent_requests(grpc, model, capsys):
    """36 mixed requests over a pool that cannot hold them: all answered with their offline
    tokens, the pool free afterwards. They are sent to a paused engine, so what runs at once
    does not depend on the machine's speed: the engine admits them until the pool is full
    (at least as many as the largest ones that fit) and queues the rest."""
    cases = make_cases(model.config, 36, seed=7, pages=(1, 4), images=(4, 48), max_new_tokens=(1, 8))
    expected = expected_tokens(model, cases, kv_block_size=ENGINE.kv_block_size)
    needs = sorted((ENGINE.blocks_for(len(c.ids) + c.max_new_tokens - 1) for c in cases), reverse=True)
    least = next(k for k in range(len(needs) + 1) if sum(needs[: k + 1]) > ENGINE.num_blocks)
    assert sum(needs) > 3 * ENGINE.num_blocks and least >= 4  # the case: most must wait, many run at once
    before = grpc.stats()
    box = {}
    load = threading.Thread(target=lambda: box.setdefault("report", run_load(grpc, cases, expected)))
    with paused_engine(grpc):
        load.start()
        held = _wait_for(grpc, lambda s: s["submitted"] - before["submitted"] == len(cases), "the requests' arrival")
    load.join(600)
    assert not load.is_alive(), "the requests did not finish in 600 s"
    report = box["report"]
    with capsys.disabled():
        print("\n" + report.summary())
    assert report.correct == len(cases) and not report.wrong and not report.errors and not report.missing
    assert report.pool_free and report.ok
    assert held["running"] >= least and held["waiting"] == len(cases) - held["running"]
    s = report.stats_after
    assert s["done"] - before["done"] == len(cases) and s["waited"] > before["waited"]


def test_malformed_requests_mixed_into_128_concurrent_good_ones(server, grpc, model, capsys):
    """128 good requests in flight over a pool that cannot hold them, every malformed request
    of _bad_requests sent three times while all 128 are in the engine (paused until then, so
    the mix does not depend on timing): every good one answered with its offline tokens,
    every bad one refused with its own status and message, nothing lost, the pool free."""
    from tritonclient.utils import InferenceServerException

    cases = make_cases(model.config, 128, seed=13, pages=(1, 3), images=(4, 32), max_new_tokens=(1, 6))
    expected = expected_tokens(model, cases, kv_block_size=ENGINE.kv_block_size)
    before = grpc.stats()
    box = {}
    load = threading.Thread(target=lambda: box.setdefault("report", run_load(grpc, cases, expected)))
    bad = _bad_requests(model.config, cases[0].ids) * 3
    refused = []
    with paused_engine(grpc):
        load.start()
        _wait_for(grpc, lambda s: s["submitted"] - before["submitted"] == 128, "the 128 requests' arrival")
        for protocol, arrays, _, fragment in bad:
            with pytest.raises(InferenceServerException) as e:
                _raw_infer(server, protocol, arrays)
            refused.append((str(e.value.status()), fragment in e.value.message()))
        assert grpc.stats()["done"] == before["done"]  # none of the 128 has finished yet
    load.join(600)
    assert not load.is_alive(), "the 128 requests did not finish in 600 s"
    report = box["report"]
    with capsys.disabled():
        print(
            f"\n{report.summary()}\nmalformed: {len(bad)} sent while they ran, "
            f"{sum(ok for _, ok in refused)} refused with their own message"
        )
    assert refused == [(status, True) for _, _, status, _ in bad]
    assert report.correct == 128 and not report.wrong and not report.errors and not report.missing
    assert report.pool_free and report.ok
    s = report.stats_after
    assert s["done"] - before["done"] == 128 and s["failed"] == before["failed"]
    assert s["kv_blocks_free"] == ENGINE.num_blocks and s["kv_blocks_reserved"] == 0 and s["kv_blocks_pinned"] == 0
    assert s["waited"] > before["waited"]  # the pool could not hold them all at once


# ------------------------------------------------------------------ Triton's surface
#: Request shapes that crash Triton 2.51's HTTP front end (SIGSEGV: every request in flight is
#: lost): an INT64 input declared with 2^40, 2^61 or 2^62 elements and sent with one value.
CRASHING_SHAPES = (2**40, 2**61, 2**62)
RESTRICTED = "This API is restricted, expecting header 'dash-admin-key'"


def _http_post(url, path, body) -> tuple[int, str]:
    """(status, body) of a POST without any key to Triton's HTTP front end at ``url``."""
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"http://{url}{path}", data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@contextlib.contextmanager
def _shm_object(data: bytes):
    """A /dev/shm object of this test's own (a name no one else uses), removed afterwards;
    yields its shared-memory key ("/name")."""
    import secrets

    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this machine")
    path = f"/dev/shm/dash-test-{os.getpid()}-{secrets.token_hex(6)}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.write(fd, data)
        yield "/" + os.path.basename(path)
    finally:
        os.close(fd)
        os.unlink(path)


def test_restricted_apis_refuse_a_client_without_the_admin_key(server):
    """Registering a /dev/shm object as a shared-memory region (a request could then read it
    through error messages and overwrite it through outputs), the repository index and model
    control, statistics, trace and log settings: refused over HTTP and gRPC to a client without
    the admin key or with a wrong one; the key opens them. What clients use stays open."""
    from functools import partial

    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    from dash_trt.triton.server import admin_key_plugin

    with _shm_object(b"not for clients " * 8) as key:
        for mod, url in ((httpclient, server.http_url), (grpcclient, server.grpc_url)):
            for sent in (None, "x" * 43):  # no key, a wrong key
                client = mod.InferenceServerClient(url)
                if sent:
                    client.register_plugin(admin_key_plugin(sent))
                try:
                    for call in (
                        partial(client.register_system_shared_memory, "probe", key, 64),
                        client.get_system_shared_memory_status,
                        client.get_model_repository_index,
                        partial(client.unload_model, "dash"),
                        client.get_inference_statistics,
                        client.get_trace_settings,
                        client.get_log_settings,
                        partial(client.update_log_settings, {"log_verbose_level": 1}),
                    ):
                        with pytest.raises(InferenceServerException, match="is restricted, expecting header"):
                            call()
                    assert client.is_server_ready() and client.is_model_ready("dash")
                    assert client.get_model_config("dash")
                finally:
                    client.close()
            client = mod.InferenceServerClient(url)
            client.register_plugin(admin_key_plugin(server.admin_key))
            try:
                client.register_system_shared_memory("probe", key, 64)
                assert key in str(client.get_system_shared_memory_status())
                client.unregister_system_shared_memory("probe")
                assert key not in str(client.get_system_shared_memory_status())
                assert "dash" in str(client.get_model_repository_index())
            finally:
                client.close()


def test_requests_that_crash_triton_are_refused_while_128_good_ones_run(server, grpc, model, capsys):
    """The requests that crash Triton 2.51 (HTTP inference with a huge declared shape) and a
    shared-memory registration of a /dev/shm object, sent without the key while 128 good
    requests are held by the engine (paused until then: the mix does not depend on timing):
    each refused with 403, the server stays up, every good request gets its offline tokens."""
    cases = make_cases(model.config, 128, seed=29, pages=(1, 3), images=(4, 32), max_new_tokens=(1, 6))
    expected = expected_tokens(model, cases, kv_block_size=ENGINE.kv_block_size)
    before = grpc.stats()
    box = {}
    load = threading.Thread(target=lambda: box.setdefault("report", run_load(grpc, cases, expected)))
    answers = []
    with paused_engine(grpc):
        load.start()
        _wait_for(grpc, lambda s: s["submitted"] - before["submitted"] == 128, "the 128 requests' arrival")
        for n in CRASHING_SHAPES:
            body = {"inputs": [{"name": P.INPUT_IDS, "shape": [n], "datatype": "INT64", "data": [1]}]}
            answers.append(_http_post(server.http_url, "/v2/models/dash/infer", body))
        with _shm_object(b"secret " * 16) as key:
            body = {"key": key, "offset": 0, "byte_size": 64}
            answers.append(_http_post(server.http_url, "/v2/systemsharedmemory/region/x/register", body))
        assert server.alive()
        assert grpc.stats()["done"] == before["done"]  # none of the 128 has finished yet
    load.join(600)
    assert not load.is_alive(), "the 128 requests did not finish in 600 s"
    report = box["report"]
    with capsys.disabled():
        print(f"\n{report.summary()}\nred-team requests while they ran: {[code for code, _ in answers]}")
    assert answers == [(403, json.dumps({"error": RESTRICTED}, separators=(",", ":")))] * (len(CRASHING_SHAPES) + 1)
    assert report.correct == 128 and not report.wrong and not report.errors and not report.missing
    assert report.pool_free and report.ok and server.alive()


@pytest.mark.parametrize(
    "extra, why",
    [
        (["--http-address", "0.0.0.0", "--expose-triton-http"], "a non-loopback --http-address does not allow"),
        (["--key-http-inference"], "--key-http-inference contradicts"),
    ],
)
def test_serve_refuses_open_http_inference_where_it_would_be_exposed(tmp_path, model, extra, why):
    """--open-http-inference (HTTP inference without the key) is refused with exit 2 on a
    non-loopback address and beside the old opt-in, before any server starts."""
    import io

    from dash_trt.triton.cli import main as dash_triton

    write_repository(tmp_path / "repo", model, engine=ENGINE, streaming=False, warmup=False)
    err = io.StringIO()
    argv = ["serve", str(tmp_path / "repo"), "--open-http-inference", *extra]
    assert dash_triton(argv, stdout=io.StringIO(), stderr=err) == 2
    assert why in err.getvalue()


def test_serve_refuses_a_non_loopback_http_address_without_the_opt_in(tmp_path, model):
    """Triton's HTTP front end on a non-loopback address needs --expose-triton-http: refused with
    exit 2 before any server starts."""
    import io

    from dash_trt.triton.cli import main as dash_triton

    write_repository(tmp_path / "repo", model, engine=ENGINE, streaming=False, warmup=False)
    err = io.StringIO()
    argv = ["serve", str(tmp_path / "repo"), "--http-address", "0.0.0.0", "--admin-key-file", str(tmp_path / "k")]
    assert dash_triton(argv, stdout=io.StringIO(), stderr=err) == 2
    assert "--http-address 0.0.0.0 is not a loopback address" in err.getvalue()
    assert "dash-triton openai, or pass --expose-triton-http" in err.getvalue()
    assert not (tmp_path / "k").exists()


def test_serve_keys_http_inference_and_gives_the_admin_key_to_its_owner_only(tmp_path, model):
    """`serve --admin-key-file PATH` (HTTP inference keyed by default): the key file is 0600
    whatever the umask; the crashing HTTP request is refused (403) and the server stays up;
    dash-client over gRPC (its default) needs no key, over HTTP it works with the key file, as
    dash-triton probe does; SIGTERM stops it with exit 0."""
    import io
    import signal
    import stat

    from dash_trt.triton.cli import main as dash_triton

    repo = _fault_repo(tmp_path, model, streaming=False)
    key_file = tmp_path / "admin.key"
    old = os.umask(0o022)
    try:
        serve, grpc_url = _serve(repo, "--admin-key-file", str(key_file))
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        http_url = serve.ready_line.split("HTTP ", 1)[1].split(",", 1)[0]
        body = {"inputs": [{"name": P.INPUT_IDS, "shape": [CRASHING_SHAPES[0]], "datatype": "INT64", "data": [1]}]}
        assert _http_post(http_url, "/v2/models/dash/infer", body)[0] == 403
        prompt = M.document_prompt([20, 9], "Keyed?", model.config)
        want_tokens = offline(model, [prompt], [4])[0]
        out = io.StringIO()
        ids = ["--ids", ",".join(map(str, prompt)), "--max-new-tokens", "4", "--json"]
        argv = ["--url", http_url, "--protocol", "http", *ids]
        assert C.main([*argv, "--admin-key-file", str(key_file)], stdout=out, stderr=io.StringIO()) == 0
        assert json.loads(out.getvalue())["tokens"] == want_tokens
        out = io.StringIO()
        assert C.main(["--url", grpc_url, *ids], stdout=out, stderr=io.StringIO()) == 0  # gRPC: no key
        assert json.loads(out.getvalue())["tokens"] == want_tokens
        out = io.StringIO()
        probe = ["probe", "--url", grpc_url, "--admin-key-file", str(key_file)]
        assert dash_triton(probe, stdout=out, stderr=out) == 0, out.getvalue()
        assert out.getvalue().startswith("ok dash: ")
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            serve.wait(60)
    assert serve.returncode == 0, serve.stderr.read()[-2000:]


def _wait_for(client, condition, what, limit=120.0):
    """Poll the engine's statistics until ``condition(stats)`` holds. The outcome does not
    depend on how fast the machine is: ``limit`` only turns a hang into a failure."""
    deadline = time.monotonic() + limit
    while True:
        stats = client.stats()
        if condition(stats):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen in {limit:.0f} s; engine stats {stats}")
        time.sleep(0.05)


@contextlib.contextmanager
def paused_engine(client):
    """The engine runs no model step inside the block: a request sent then cannot finish, so
    a deadline or a cancellation always reaches it while it is queued or running."""
    assert client.control("pause")["paused"]
    try:
        yield
    finally:
        assert not client.control("resume")["paused"]


def test_engine_control_is_off_unless_enabled(model):
    from dash_trt.triton import repository as R

    on = R.python_model_config("dash", model, ENGINE, streaming=False, allow_engine_control=True)
    off = R.python_model_config("dash", model, ENGINE, streaming=False)
    value = {p["key"]: p["value"]["string_value"] for p in on["parameters"]}[P.PARAM_ALLOW_CONTROL]
    assert value == "true"
    assert {p["key"]: p["value"]["string_value"] for p in off["parameters"]}[P.PARAM_ALLOW_CONTROL] == "false"


def test_engine_control_rejects_unknown_actions(grpc):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as e:
        _raw_infer_grpc_control(grpc, "explode")
    assert "engine_control must be one of pause, resume, got 'explode'" in e.value.message()
    assert not grpc.stats()["paused"]


def _raw_infer_grpc_control(client, action):
    import tritonclient.grpc as g

    ids = g.InferInput(P.INPUT_IDS, [0], "INT64")
    ids.set_data_from_numpy(np.zeros(0, dtype=np.int64))
    raw = np.frombuffer(action.encode(), dtype=np.uint8)
    c = g.InferInput(P.ENGINE_CONTROL, [raw.size], "UINT8")
    c.set_data_from_numpy(raw)
    return client.client.infer("dash", [ids, c])


def test_client_deadline_cancels_the_request_and_frees_its_blocks(server, model, grpc):
    prompt = M.document_prompt([48, 48], "Describe everything.", model.config)
    with paused_engine(grpc):
        before = grpc.stats()
        with C.DashClient(server.grpc_url, protocol="grpc", timeout=0.3) as hasty:
            with pytest.raises(C.DashClientError) as e:
                hasty.generate(prompt, ENGINE.max_new_tokens_limit, stop_at_eos=False)
            assert e.value.status == "StatusCode.DEADLINE_EXCEEDED"
        # Triton passed the gRPC deadline to the model as a cancellation: the engine failed
        # the request while it was queued or running, before any step could run it
        s = _wait_for(grpc, lambda s: s["failed"] == before["failed"] + 1, "the request's cancellation")
    assert s["running"] == s["waiting"] == 0
    assert s["kv_blocks_free"] == ENGINE.num_blocks and s["kv_blocks_reserved"] == 0
    assert s["tokens_generated"] == before["tokens_generated"]


def test_cancelled_running_request_gives_back_its_blocks(server, model, grpc):
    # a document of its own: no block of it in the prefix cache, so all its prompt's blocks are
    # taken at admission (KV on demand: it grows as it generates)
    prompt = M.document_prompt([48, 48], "Describe everything.", model.config, preamble="Cancelled: ")
    assert ENGINE.kv_on_demand
    need = ENGINE.blocks_for(len(prompt))
    answers = []
    with paused_engine(grpc):
        before = grpc.stats()
        call = grpc.client.async_infer(
            "dash",
            grpc._inputs(prompt, ENGINE.max_new_tokens_limit, False),
            lambda result, error: answers.append((result, error)),
        )
        # admitted while paused: its prompt's blocks are taken, no step has run
        s = _wait_for(grpc, lambda s: s["running"] == 1, "the request's admission")
        assert s["kv_blocks_reserved"] == need and s["tokens_generated"] == before["tokens_generated"]
        call.cancel()
        s = _wait_for(grpc, lambda s: s["failed"] == before["failed"] + 1, "the request's cancellation")
    assert s["running"] == s["waiting"] == 0
    assert s["kv_blocks_free"] == ENGINE.num_blocks and s["kv_blocks_reserved"] == 0
    assert s["tokens_generated"] == before["tokens_generated"]
    assert len(answers) == 1 and answers[0][1] is not None and "CANCELLED" in str(answers[0][1].status())
    # and the engine serves normally again after the resume
    assert grpc.generate(prompt, 2).tokens == offline(model, [prompt], [2])[0]


def test_a_model_that_fails_to_load_is_named_with_its_reason(tmp_path, model):
    """A repository whose checkpoint is damaged: start() raises with each model's load error
    from the server log (not Triton's option table) and says where the log is kept, a copy
    that survives cleanup() of the scratch folder."""
    try:
        from dash_trt.triton.server import TritonServer, TritonStartError, TritonUnavailable
    except ImportError as exc:
        _unavailable(str(exc))
    write_repository(tmp_path / "repo", model, engine=ENGINE, streaming=False)
    (ckpt,) = list((tmp_path / "repo").rglob("model.pt"))
    ckpt.write_bytes(b"not a checkpoint")
    try:
        srv = TritonServer(str(tmp_path / "repo"))
    except TritonUnavailable as exc:
        _unavailable(str(exc))
    try:
        with pytest.raises(TritonStartError) as info:
            srv.start(timeout=120)
    finally:
        srv.cleanup()
    text = str(info.value)
    assert "model 'dash' version 1 failed to load" in text and "CheckpointError" in text, text
    assert "not a readable PyTorch checkpoint" in text and "weights_only" not in text
    assert "model_control_mode" not in text  # the option table is not the message
    kept = text.rsplit("(server log: ", 1)[1].rstrip(")")
    assert os.path.isfile(kept) and "failed to load" in open(kept).read()
    os.unlink(kept)


def test_sampling_with_a_seed_is_reproducible_and_stop_lists_end_generation(http, grpc, model, prompts, want):
    """Through the real server: a seeded sampling request gives the same tokens over HTTP,
    gRPC and the streaming model, and the same as the engine offline; a stop list ends the
    generation at its first stop token; a request without sampling stays greedy."""
    from dash_trt.serving.engine import GenerationEngine

    s = {"temperature": 1.0, "top_k": 50, "top_p": 0.9, "seed": 1234}
    got = [c.generate(prompts[0], 8, stop_at_eos=False, sampling=s).tokens for c in (http, grpc, http)]
    streamed = grpc.stream(prompts[0], 8, stop_at_eos=False, sampling=s).tokens
    assert got[0] == got[1] == got[2] == streamed and len(got[0]) == 8
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        offline_engine = GenerationEngine(model, ENGINE)
        assert offline_engine.generate([prompts[0]], 8, stop_at_eos=False, sampling=s)[0] == got[0]
    finally:
        torch.set_num_threads(threads)
    assert grpc.generate(prompts[0], 8, stop_at_eos=False, sampling={**s, "seed": 99}).tokens != got[0]
    stop = want[0][2]
    stopped = grpc.generate(prompts[0], 8, stop_token_ids=[stop]).tokens
    assert stopped == want[0][: want[0].index(stop) + 1]
    assert http.generate(prompts[0], 8).tokens == want[0]
    with pytest.raises(C.DashClientError, match="temperature must be"):
        http.generate(prompts[0], 4, sampling={"temperature": -2.0})


def _server_or_skip(repo, **kw):
    try:
        from dash_trt.triton.server import TritonServer, TritonUnavailable
    except ImportError as exc:
        _unavailable(str(exc))
    try:
        return TritonServer(str(repo), **kw)
    except TritonUnavailable as exc:
        _unavailable(str(exc))


def test_a_port_in_use_is_refused_before_the_server_starts(tmp_path, model):
    """A port already taken (e.g. by a server a killed `serve` left behind) is named, instead
    of a readiness probe that reaches the other server and reports ready."""
    import socket

    from dash_trt.triton.server import TritonStartError

    write_repository(tmp_path / "repo", model, engine=ENGINE, streaming=False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        srv = _server_or_skip(tmp_path / "repo", http_port=port)
        try:
            with pytest.raises(TritonStartError, match=f"port {port} on 127.0.0.1 is already in use"):
                srv.start(timeout=60)
            assert srv.proc is None
        finally:
            srv.cleanup()
        # dash-triton serve: the exit code its --help gives for a port in use
        import io

        from dash_trt.triton.cli import _parser
        from dash_trt.triton.cli import main as dash_triton

        serve_help = " ".join(_parser()._subparsers._group_actions[0].choices["serve"].format_help().split())
        assert "2 bad input (no repository, a port in use" in serve_help
        err = io.StringIO()
        argv = ["serve", str(tmp_path / "repo"), "--http-port", str(port), "--timeout", "60"]
        assert dash_triton(argv, stdout=io.StringIO(), stderr=err) == 2, err.getvalue()
        assert f"port {port} on 127.0.0.1 is already in use" in err.getvalue()


def test_ready_is_announced_only_for_its_own_server(tmp_path, model, monkeypatch):
    """Check-then-bind: another server takes the HTTP port after the port check and answers the
    readiness probe. The start must not report that server ready: it fails (this server could
    not bind the port) naming the port in use."""
    import http.server

    from dash_trt.triton import server as S

    class Ready(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            probes.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    probes: list[str] = []
    write_repository(tmp_path / "repo", model, engine=ENGINE, streaming=False, warmup=False)
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ready)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    port = other.server_address[1]
    monkeypatch.setattr(S, "port_in_use", lambda port: False)  # the check ran before the other bound
    srv = _server_or_skip(tmp_path / "repo", http_port=port, grpc_port=S.free_ports(1)[0])
    try:
        with pytest.raises(S.TritonPortInUse, match="already in use") as e:
            srv.start(timeout=240)
        assert probes and set(probes) == {"/v2/health/ready"}  # the other server did answer ready
        assert str(port) in str(e.value)
    finally:
        srv.cleanup()
        other.shutdown()
        other.server_close()


def test_the_server_does_not_outlive_a_killed_parent(tmp_path, model):
    """kill -9 of the process that started tritonserver (dash-triton serve) takes the server
    down too (PR_SET_PDEATHSIG): no orphan holding the ports."""
    import signal
    import subprocess
    import sys

    _ = _server_or_skip  # the import check
    write_repository(tmp_path / "repo", model, engine=ENGINE, streaming=False)
    code = (
        "import sys, time; from dash_trt.triton.server import TritonServer; "
        f"s = TritonServer({str(tmp_path / 'repo')!r}); s.start(timeout=120); "
        "print(s.proc.pid, flush=True); time.sleep(600)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        line = parent.stdout.readline()
        if not line.strip():
            _unavailable("the server did not start in the child process")
        child = int(line)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        for _ in range(600):  # up to 60 s for Triton's own shutdown (exit_timeout 20 s)
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            with open(f"/proc/{child}/stat") as fh:
                if fh.read().split(")")[-1].split()[0] == "Z":  # exited, not yet reaped
                    break
            time.sleep(0.1)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail("tritonserver outlived the killed process that started it")
    finally:
        if parent.poll() is None:
            parent.kill()


def _metrics(server) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("dash_") and 'model="dash"' in line:
            name, value = line.rsplit(" ", 1)
            out[name.replace('model="dash",', "").replace(',model="dash"', "").replace('{model="dash"}', "")] = float(
                value
            )
    return out


def test_generation_metrics_on_the_metrics_endpoint(server, grpc, prompts, model):
    """Triton's metrics endpoint carries the generation model's counters and gauges
    (dash_trt.triton.metrics): three requests add exactly their requests, prompt and
    generated tokens and first tokens; the pool gauges show it free afterwards."""
    before = _metrics(server)
    assert 'dash_requests_total{outcome="done"}' in before, sorted(before)
    got = [grpc.generate(p, 4, stop_at_eos=False) for p in prompts]
    # ... and a second question on the first document: its document blocks come from the cache
    again = prompts[0][: -len(b"Read page 2.")] + list(b"Any table?")
    got.append(grpc.generate(again, 4, stop_at_eos=False))
    after = _metrics(server)

    def delta(name):
        return after[name] - before.get(name, 0.0)

    assert delta('dash_requests_total{outcome="done"}') == 4
    assert delta("dash_prompt_tokens_total") == sum(len(p) for p in prompts) + len(again)
    assert delta("dash_generated_tokens_total") == sum(len(g.tokens) for g in got) == 16
    assert delta("dash_first_tokens_total") == 4
    cached = sum(g.cached_tokens for g in got)
    assert got[-1].cached_tokens > 0 and delta("dash_prompt_tokens_cached_total") == cached
    assert delta("dash_prompt_tokens_computed_total") == delta("dash_prompt_tokens_total") - cached
    assert after["dash_kv_blocks_cached"] > 0
    assert delta("dash_time_to_first_token_seconds") > 0 and delta("dash_request_seconds") > 0
    assert after["dash_kv_blocks_total"] == ENGINE.num_blocks
    assert after["dash_kv_blocks_in_use"] == 0 and after["dash_requests_running"] == 0
    page = model.config.page_token_id
    assert delta("dash_pages_total") == sum(p.count(page) for p in [*prompts, again]) == 11
    assert after["dash_pages_in_flight"] == 0


# ------------------------------------------------------------------ fault injection
# Each fault hits 128 requests in flight (the engine paused until all have arrived, so none
# can finish first: the outcome does not depend on the machine's speed) and asserts what
# every client got, that nothing was lost or left hanging, and that no process and no
# shared-memory region is left behind. The figures go to the test log.
FAULT_REQUESTS = 128


def _serve(repo, *args):
    """`dash-triton serve repo` on free ports, once it printed "ready": (process, gRPC url)."""
    import subprocess
    import sys

    from dash_trt.triton.server import free_ports

    _ = _server_or_skip  # the import check
    for _ in range(3):  # a port found free can be taken by another process before serve binds it
        http_port, grpc_port = free_ports(2)
        serve = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dash_trt.triton.cli",
                "serve",
                str(repo),
                "--http-port",
                str(http_port),
                "--grpc-port",
                str(grpc_port),
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = serve.stdout.readline()
        if line.startswith("ready"):
            serve.ready_line = line
            return serve, f"127.0.0.1:{grpc_port}"
        serve.kill()
        err = serve.stderr.read()
        if "already in use" not in err:
            break
    _unavailable(f"serve did not start: {line!r} {err[-2000:]}")


def _children(pid: int) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == pid]


def _server_and_workers(serve) -> tuple[int, list[int]]:
    """The tritonserver that `serve` started, and that server's model workers."""
    (server_pid,) = _children(serve.pid)
    return server_pid, _children(server_pid)


def _stubs() -> list[int]:
    """Every live Python-backend stub on the machine (any server's)."""
    found = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as fh:
                if b"triton_python_backend_stub" in fh.read().split(b"\0")[0] and _ppid(int(p)) is not None:
                    found.append(int(p))
        except OSError:
            continue
    return found


class _Answers:
    """Collects the answers of requests sent with generate_async; ``wait`` until all came."""

    def __init__(self, cases):
        self.cases, self.n = cases, len(cases)
        self.got, self.lock, self.all = [], threading.Lock(), threading.Event()
        self.by_case: dict[int, object] = {}

    def callback(self, i: int):
        def keep(result):
            with self.lock:
                self.got.append((time.monotonic(), result))
                self.by_case[i] = result
                if len(self.got) == self.n:
                    self.all.set()

        return keep

    def statuses(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, r in self.got:
            key = r.status if isinstance(r, C.DashClientError) else "tokens"
            out[key] = out.get(key, 0) + 1
        return out


def _in_flight(client, model, n=FAULT_REQUESTS, max_new=(6, 6), seed=21) -> _Answers:
    """``n`` requests (``max_new``: the range of their new tokens) submitted to a paused
    engine, all of them held by it on return."""
    cases = make_cases(model.config, n, seed=seed, pages=(1, 3), images=(4, 32), max_new_tokens=max_new)
    answers = _Answers(cases)
    before = client.stats()
    assert client.control("pause")["paused"]
    for i, case in enumerate(cases):
        client.generate_async(list(case.ids), case.max_new_tokens, answers.callback(i), stop_at_eos=False)
    _wait_for(client, lambda s: s["submitted"] - before["submitted"] == n, f"the {n} requests' arrival")
    return answers


def _regions_of(*pids: int) -> set[str]:
    """The /dev/shm regions these processes (the test's own server and its workers) map."""
    from dash_trt.triton.server import _shm_regions_mapped_by

    return set().union(*(_shm_regions_mapped_by(pid) for pid in pids))


def _left_behind(regions: set[str]) -> set[str]:
    """Which of ``regions`` (the test's own) are still in /dev/shm: what else runs on the
    machine does not count."""
    return {r for r in regions if os.path.exists(os.path.join("/dev/shm", r))}


def _fault_repo(tmp_path, model, **kw):
    write_repository(
        tmp_path / "repo", model, engine=kw.pop("engine", ENGINE), allow_engine_control=True, warmup=False, **kw
    )
    return tmp_path / "repo"


def test_a_killed_worker_under_128_requests_ends_serve_with_every_request_answered(tmp_path, model, capsys):
    """kill -9 of the model's worker with 128 requests in flight: Triton would keep reporting the
    model ready while those requests hang until their deadline; `dash-triton serve` names the
    dead worker, stops the server and exits 3, every client is answered at once (Triton's
    INTERNAL "not healthy" or UNAVAILABLE as the server goes), nothing is left behind, and a
    supervisor's restart on the same repository serves correct answers again."""
    import signal

    repo = _fault_repo(tmp_path, model, streaming=False)
    serve, url = _serve(repo)
    try:
        server_pid, stubs = _server_and_workers(serve)
        assert len(stubs) == 1, stubs
        regions = _regions_of(server_pid, *stubs)
        assert regions, "the server maps no shared-memory region"
        with C.DashClient(url, protocol="grpc", timeout=300) as c:
            answers = _in_flight(c, model)
            killed = time.monotonic()
            os.kill(stubs[0], signal.SIGKILL)
            # A bound 50x above the measured 0.1-0.3 s, that a hang or Triton's own stop (which
            # waits 30 s for the answers a dead worker never gives) exceeds
            assert answers.all.wait(15), f"{len(answers.got)} of {FAULT_REQUESTS} answered; the rest hang"
            code = serve.wait(timeout=120)
        err = serve.stderr.read()
        assert code == 3 and f"a model worker died (pid {stubs[0]}" in err, err[-2000:]
        assert _ppid(server_pid) is None and stubs[0] not in _stubs()  # server and worker gone
        statuses = answers.statuses()
        assert set(statuses) <= {"StatusCode.INTERNAL", "StatusCode.UNAVAILABLE"}, statuses
        for _, r in answers.got:
            assert r.status == "StatusCode.UNAVAILABLE" or "is not healthy" in str(r), str(r)
        last = max(t for t, _ in answers.got) - killed
        assert not _left_behind(regions), _left_behind(regions)
        # the supervisor's part: a fresh serve on the same repository answers correctly
        prompt = M.document_prompt([20, 9], "After the restart?", model.config)
        want_after = offline(model, [prompt], [5])[0]
        restart = time.monotonic()
        serve, url = _serve(repo)
        ready = time.monotonic() - restart
        restarted, restarted_stubs = _server_and_workers(serve)
        regions |= _regions_of(restarted, *restarted_stubs)
        with C.DashClient(url, protocol="grpc", timeout=120) as c:
            assert c.generate(prompt, 5, stop_at_eos=False).tokens == want_after
        recovered = time.monotonic() - restart
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            serve.wait(60)
    assert serve.returncode == 0
    assert not _left_behind(regions), _left_behind(regions)
    with capsys.disabled():
        print(
            f"\nkilled worker: {FAULT_REQUESTS} in flight, {len(answers.got)} answered ({statuses}), lost 0, "
            f"last answer {last:.2f} s after the kill, serve exit {code}; restart ready in {ready:.1f} s, "
            f"first correct answer {recovered:.1f} s after the restart"
        )


def test_a_killed_server_under_128_requests_is_cleaned_up_by_serve(tmp_path, model, capsys):
    """kill -9 of tritonserver itself with 128 requests in flight: every client gets UNAVAILABLE
    at once (the connection is gone), serve says so and exits 3, and it stops the server's
    orphaned model workers and removes their shared memory (Triton did not get to)."""
    import signal

    repo = _fault_repo(tmp_path, model, streaming=True)
    serve, url = _serve(repo)
    try:
        server_pid, stubs = _server_and_workers(serve)
        assert len(stubs) == 2, stubs  # the unary and the streaming model
        regions = _regions_of(server_pid, *stubs)
        assert len(regions) >= 2, regions
        with C.DashClient(url, protocol="grpc", timeout=300) as c:
            answers = _in_flight(c, model)
            killed = time.monotonic()
            os.kill(server_pid, signal.SIGKILL)
            assert answers.all.wait(60), f"{len(answers.got)} of {FAULT_REQUESTS} answered; the rest hang"
            code = serve.wait(timeout=120)
        err = serve.stderr.read()
        assert code == 3 and "tritonserver exited" in err, err[-2000:]
        assert "2 orphaned model worker(s) stopped, 2 shared-memory region(s) removed" in err, err[-2000:]
        assert not set(stubs) & set(_stubs())
        assert answers.statuses() == {"StatusCode.UNAVAILABLE": FAULT_REQUESTS}, answers.statuses()
        assert not _left_behind(regions), _left_behind(regions)
    finally:
        if serve.poll() is None:
            serve.kill()
    with capsys.disabled():
        print(
            f"\nkilled server: {FAULT_REQUESTS} in flight, all answered UNAVAILABLE, lost 0, last "
            f"{max(t for t, _ in answers.got) - killed:.2f} s after the kill; serve exit {code}, 2 orphaned "
            f"workers stopped, 2 shared-memory regions removed"
        )


def test_sigterm_under_128_requests_answers_every_one_and_exits_0(tmp_path, model, capsys):
    """SIGTERM to `dash-triton serve` with 128 long requests, some running and the rest queued:
    every client gets an answer (its tokens, or UNAVAILABLE "shutting down"; never a dropped
    connection), serve exits 0 within the grace, no tritonserver or worker is left and no
    shared-memory region leaks."""
    import signal

    engine = EngineConfig(num_blocks=512, kv_block_size=16, max_new_tokens_limit=512)
    repo = _fault_repo(tmp_path, model, streaming=True, engine=engine)
    serve, url = _serve(repo, "--grace", "1")
    try:
        server_pid, stubs = _server_and_workers(serve)
        regions = _regions_of(server_pid, *stubs)
        with C.DashClient(url, protocol="grpc", timeout=300) as c:
            answers = _in_flight(c, model, max_new=(4, 400))
            assert not c.control("resume")["paused"]
            s = _wait_for(c, lambda s: s["running"] > 0 and s["tokens_generated"] > 0, "generation under way")
            assert s["waiting"] > 0  # the pool holds only some of them: the rest are queued
            signalled = time.monotonic()
            serve.send_signal(signal.SIGTERM)
            code = serve.wait(timeout=120)
            stopped = time.monotonic() - signalled
            assert answers.all.wait(30), f"{len(answers.got)} of {FAULT_REQUESTS} answered"
        err = serve.stderr.read()
        assert code == 0, err[-2000:]
        statuses = answers.statuses()
        assert set(statuses) <= {"tokens", "StatusCode.UNAVAILABLE"}, statuses
        for i, r in answers.by_case.items():  # all its tokens, or UNAVAILABLE "shutting down"
            if isinstance(r, C.DashClientError):
                assert "shutting down" in str(r), str(r)
            else:
                assert len(r.tokens) == answers.cases[i].max_new_tokens
        assert statuses.get("StatusCode.UNAVAILABLE", 0) >= s["waiting"] - statuses.get("tokens", 0)
        assert _ppid(server_pid) is None and not set(stubs) & set(_stubs())
        assert regions and not _left_behind(regions), _left_behind(regions)
    finally:
        if serve.poll() is None:
            serve.kill()
    with capsys.disabled():
        print(
            f"\nSIGTERM: {FAULT_REQUESTS} in flight ({s['running']} running, {s['waiting']} queued), answered "
            f"{statuses}, lost 0; serve exit 0 {stopped:.1f} s after the signal (grace 1 s)"
        )


HANGING_MODEL = """
import os
import threading


class TritonPythonModel:
    def initialize(self, args):
        # tell the test that loading has begun, then never finish
        open(os.path.join(os.path.dirname(args["model_repository"]), "loading"), "w").close()
        threading.Event().wait()
"""


def _hanging_repo(tmp_path):
    """A repository whose one Python-backend model never finishes loading; it writes the file
    ``loading`` in the repository when its initialize has begun."""
    folder = tmp_path / "repo" / "hang"
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(HANGING_MODEL)
    (folder / "config.pbtxt").write_text(
        'name: "hang"\nbackend: "python"\nmax_batch_size: 0\n'
        'input [{ name: "x" data_type: TYPE_INT64 dims: [ 1 ] }]\n'
        'output [{ name: "y" data_type: TYPE_INT64 dims: [ 1 ] }]\n'
    )
    return tmp_path / "repo"


def test_sigterm_while_a_model_hangs_at_load_stops_serve_and_leaves_nothing(tmp_path):
    """SIGTERM to `dash-triton serve` while a model's initialize hangs (sent once the model has
    begun loading, seen through a file it writes): serve kills the server at once (nothing is
    served yet) and exits 0, long before its --timeout; the server, the model's worker and the
    shared-memory regions the server had mapped are gone."""
    import signal
    import subprocess
    import sys

    from dash_trt.triton.server import _shm_regions_mapped_by, free_ports

    _ = _server_or_skip  # the import check
    repo = _hanging_repo(tmp_path)
    http_port, grpc_port = free_ports(2)
    serve = subprocess.Popen(
        [sys.executable, "-m", "dash_trt.triton.cli", "serve", str(repo), "--timeout", "3600"]
        + ["--http-port", str(http_port), "--grpc-port", str(grpc_port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240  # only turns a server that never starts into a failure
        while not (repo / "loading").exists():
            assert serve.poll() is None, serve.stderr.read()[-2000:]
            assert time.monotonic() < deadline, "the model never began loading"
            time.sleep(0.05)
        server_pid, stubs = _server_and_workers(serve)
        regions = _shm_regions_mapped_by(server_pid)
        assert stubs and regions, (stubs, regions)
        serve.send_signal(signal.SIGTERM)
        code = serve.wait(timeout=120)  # the bug: serve waited for --timeout (an hour here)
        err = serve.stderr.read()
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
    assert code == 0 and "stopped before the models were ready" in err, err[-2000:]
    assert _ppid(server_pid) is None and not set(stubs) & set(_stubs())
    assert not [r for r in regions if os.path.exists(os.path.join("/dev/shm", r))], regions


def test_serve_refuses_shell_characters_in_what_reaches_the_launch_shell(tmp_path, model):
    """Triton's Python backend starts a model's worker through `bash -c` with the model's folder,
    name and file names in the command: a `$(...)` in a model folder's name (or a config's name,
    default_model_filename, EXECUTION_ENV_PATH) is refused with exit 2 before any server starts,
    and the payload never runs."""
    import io

    from dash_trt.triton.cli import main as dash_triton
    from dash_trt.triton.repository import RepositoryError
    from dash_trt.triton.server import check_launch_names

    write_repository(tmp_path / "repo", model, engine=ENGINE, streaming=False, warmup=False)
    evil = "m$(touch pwned)"
    os.rename(tmp_path / "repo" / "dash", tmp_path / "repo" / evil)
    cfg = tmp_path / "repo" / evil / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace('name: "dash"', f'name: "{evil}"', 1))
    err = io.StringIO()
    cwd = os.getcwd()
    os.chdir(tmp_path)  # where the payload would write
    try:
        code = dash_triton(["serve", str(tmp_path / "repo"), "--timeout", "60"], stdout=io.StringIO(), stderr=err)
    finally:
        os.chdir(cwd)
    assert code == 2, err.getvalue()
    assert f"the model folder '{evil}'" in err.getvalue() and "holds ' $()'" in err.getvalue(), err.getvalue()
    assert not (tmp_path / "pwned").exists()
    # the same names inside a Python-backend config
    os.rename(tmp_path / "repo" / evil, tmp_path / "repo" / "dash")
    cfg = tmp_path / "repo" / "dash" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace(f'name: "{evil}"', 'name: "dash"', 1))
    check_launch_names(str(tmp_path / "repo"))  # the repository dash-triton wrote passes
    for field, value in (
        ("name", "dash_0 `id`"),
        ("default_model_filename", "model.py;id"),
    ):
        good = cfg.read_text().split("\n", 1)
        cfg.write_text(f'{good[0]}\ninstance_group [{{ {field}: "{value}" kind: KIND_CPU }}]\n{good[1]}')
        with pytest.raises(RepositoryError, match=f"the {field} '{re.escape(value)}' holds"):
            check_launch_names(str(tmp_path / "repo"))
        cfg.write_text("\n".join(good))
    cfg.write_text(
        cfg.read_text() + '\nparameters { key: "EXECUTION_ENV_PATH" value: { string_value: "/e/$(id).tar.gz" } }\n'
    )
    with pytest.raises(RepositoryError, match="the EXECUTION_ENV_PATH '/e/\\$\\(id\\).tar.gz' holds"):
        check_launch_names(str(tmp_path / "repo"))


def test_probe_finds_a_dead_worker_that_a_bare_tritonserver_reports_ready(tmp_path, model, capsys):
    """A tritonserver run without `serve` (nobody watches its workers): after kill -9 of one
    model's worker, `dash-triton probe` fails naming that model (exit 3) and passes the other;
    the 128 requests the dead worker held are answered once the server is restarted (what a
    supervisor does on the failed probe), and nothing is left behind."""
    import io
    import signal
    import urllib.request

    from dash_trt.triton.cli import main as dash_triton
    from dash_trt.triton.server import write_admin_key

    key_file = str(tmp_path / "admin.key")

    def probe(url, *args, key=True):
        out = io.StringIO()
        argv = ["probe", "--url", url, "--timeout", "5", *args] + (["--admin-key-file", key_file] if key else [])
        code = dash_triton(argv, stdout=out, stderr=out)
        return code, out.getvalue().strip().splitlines()

    repo = _fault_repo(tmp_path, model, streaming=True)
    srv = _server_or_skip(repo)
    try:
        srv.start(timeout=240)
        regions = _regions_of(srv.proc.pid, *srv.workers())
        write_admin_key(key_file, srv.admin_key)
        # the list of loaded models is a restricted API: without the key, exit 2 saying so
        code, lines = probe(srv.grpc_url, key=False)
        assert code == 2 and "lists its models only with its admin key" in lines[0], lines
        code, lines = probe(srv.grpc_url)
        assert code == 0 and sorted(line.split(":")[0] for line in lines) == ["ok dash", "ok dash_stream"], lines
        assert probe(srv.grpc_url, "--model", "dash_stream") == (0, [line for line in lines if "dash_stream" in line])
        code, lines = probe(srv.grpc_url, "--model", "nosuch")
        assert code == 3 and lines == [
            "FAIL nosuch: not a generation model the server has loaded (loaded: dash, dash_stream)"
        ], lines
        worker = next(pid for pid, m in srv.workers().items() if m.endswith("/dash/1/model.py"))
        with C.DashClient(srv.grpc_url, protocol="grpc", timeout=300) as c:
            answers = _in_flight(c, model)
            killed = time.monotonic()
            os.kill(worker, signal.SIGKILL)
            for _ in range(600):  # Triton notices the dead stub on the next request to it
                code, lines = probe(srv.grpc_url)
                if code != 0:
                    break
                time.sleep(0.1)
            detected = time.monotonic() - killed
            assert code == 3, lines
            failed = [line for line in lines if line.startswith("FAIL")]
            triton_says = None
            if "ok dash_stream: " in "\n".join(lines):  # the server outlived the worker (the usual case)
                assert failed and all(line.startswith("FAIL dash: ") for line in failed), lines
                assert "not healthy" in failed[0], lines
                try:
                    with urllib.request.urlopen(f"http://{srv.http_url}/v2/models/dash/ready", timeout=10) as r:
                        triton_says = r.status  # 200 under Triton 2.51: why the probe exists
                except OSError:
                    pass  # the server went down since the probe: checked below
            if triton_says is None:
                # Triton 2.51's Python backend can abort the whole server (SIGABRT, an uncaught
                # exception in its stub-health thread) right after a stub's death: the probe then
                # fails for every model, as it must. Only that is accepted here, not a live server.
                assert _exited(srv, 30), (lines, srv.log_tail())
                triton_says = f"nothing (tritonserver exited, code {srv.returncode})"
                failed = failed or lines
            srv.stop()  # the supervisor's restart
            assert answers.all.wait(60), f"{len(answers.got)} of {FAULT_REQUESTS} answered; the rest hang"
        statuses = answers.statuses()
        assert set(statuses) <= {"StatusCode.INTERNAL", "StatusCode.UNAVAILABLE"}, statuses
        assert worker not in _stubs() and regions and not _left_behind(regions), _left_behind(regions)
    finally:
        srv.cleanup()
    with capsys.disabled():
        print(
            f"\nbare tritonserver, killed worker: Triton's readiness said {triton_says}; the probe failed "
            f"{detected:.2f} s after the kill ({failed[0][:90]}); {FAULT_REQUESTS} in flight answered on the "
            f"server's stop: {statuses}, lost 0"
        )


def _exited(srv, timeout: float) -> bool:
    """Whether the server's process exits within ``timeout`` seconds (one that has already, at once)."""
    import subprocess

    try:
        srv.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return False
    return True


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[-1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else int(fields[1])


# ----------------------------------------------------------- OpenAI-style endpoint
@pytest.fixture(scope="module")
def openai(server):
    from dash_trt.triton.openai import OpenAIServer

    srv = OpenAIServer(server.http_url, server.grpc_url, port=0, allow_control_text=True).start()
    yield srv
    srv.close()


def _post(url: str, body, *, raw: bool = False):
    import urllib.error
    import urllib.request

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as res:
            text = res.read().decode()
            return res.status, (text if raw else json.loads(text))
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read().decode())


def test_the_front_door_names_tritons_address_once_triton_is_gone(tmp_path, model):
    """The front door whose Triton stopped answers 503 naming Triton's address, on the plain and
    the streaming path (it said "ConnectionRefusedError" with no address)."""
    from dash_trt.triton.openai import OpenAIServer

    write_repository(tmp_path / "repo", model, engine=ENGINE, streaming=False, warmup=False)
    srv = _server_or_skip(tmp_path / "repo")
    door = None
    try:
        srv.start(timeout=240)
        door = OpenAIServer(srv.http_url, srv.grpc_url, port=0, allow_control_text=True).start()
        body = {"model": "dash", "prompt": "<PAGE><image*8>Title?", "max_tokens": 2, "temperature": 0}
        assert _post(door.url + "/v1/completions", body)[0] == 200
        assert srv.stop() == 0
        status, res = _post(door.url + "/v1/completions", body)
        assert status == 503 and res["error"]["code"] == "service_unavailable", res
        assert res["error"]["message"].startswith(f"Triton at {srv.grpc_url} is unavailable: "), res
        status, res = _post(door.url + "/v1/completions", {**body, "stream": True})
        assert status == 503 and f"Triton at {srv.grpc_url} is unavailable: " in res["error"]["message"], res
    finally:
        if door is not None:
            door.close()
        srv.cleanup()


def test_openai_completions_answer_like_offline_generation(openai, model, prompts, want):
    text = "Doc <PAGE><image*20><PAGE><image*9><PAGE><image*14>Read page 2."
    status, res = _post(
        openai.url + "/v1/completions", {"model": "dash", "prompt": text, "max_tokens": MAX_NEW[0], "temperature": 0}
    )
    assert status == 200 and res["object"] == "text_completion"
    assert res["choices"][0]["text"] == M.detokenize(want[0], model.config)
    usage = dict(res["usage"])
    cached = usage.pop("prompt_tokens_details")["cached_tokens"]
    assert usage == {
        "prompt_tokens": len(prompts[0]),
        "completion_tokens": len(want[0]),
        "total_tokens": len(prompts[0]) + len(want[0]),
    }
    assert 0 <= cached < len(prompts[0]) and cached % ENGINE.kv_block_size == 0
    assert res["choices"][0]["finish_reason"] == ("stop" if want[0][-1] == model.config.eos_token_id else "length")
    # token-id prompts; a seeded sampled request is reproducible
    status, by_ids = _post(
        openai.url + "/v1/completions", {"prompt": prompts[1], "max_tokens": MAX_NEW[1], "temperature": 0}
    )
    assert status == 200 and by_ids["choices"][0]["text"] == M.detokenize(want[1], model.config)
    sampled = {"prompt": prompts[1], "max_tokens": 6, "temperature": 0.9, "top_k": 20, "seed": 11, "ignore_eos": True}
    first, second = (_post(openai.url + "/v1/completions", sampled)[1] for _ in range(2))
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert first["usage"]["completion_tokens"] == 6


def test_openai_streaming_sends_server_sent_events(openai, model, prompts, want):
    status, text = _post(
        openai.url + "/v1/completions",
        {
            "prompt": prompts[0],
            "max_tokens": MAX_NEW[0],
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        raw=True,
    )
    assert status == 200
    events = [e.removeprefix("data: ") for e in text.strip().split("\n\n")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == M.detokenize(want[0], model.config)
    assert chunks[-2]["choices"][0]["finish_reason"] and chunks[-1]["choices"] == []  # usage in a chunk of its own
    assert chunks[-1]["usage"]["completion_tokens"] == len(want[0])


def test_openai_errors_use_the_openai_error_object(openai, prompts):
    url = openai.url + "/v1/completions"
    cases = [
        ({"prompt": prompts[0], "stop": ["\n"]}, 400, "stop", "use stop_token_ids"),
        ({"prompt": prompts[0], "n": 2}, 400, "n", "less than or equal to 1"),
        ({"prompt": prompts[0], "max_tokens": 0}, 400, "max_tokens", "greater than or equal to 1"),
        ({"prompt": prompts[0], "temprature": 0}, 400, "temprature", "unknown parameter"),
        ({"prompt": prompts[0], "model": "other"}, 404, "model", "not served here"),
        ({"prompt": ""}, 400, "prompt", "prompt must be"),
        ({"prompt": prompts[0], "max_tokens": 100000}, 400, None, "max_new_tokens must be"),
    ]
    for body, status, param, message in cases:
        got, res = _post(url, body)
        assert got == status, (body, res)
        assert res["error"]["param"] == param and message in res["error"]["message"], (body, res)
    got, res = _post(url, b"{not json")
    assert got == 400 and "not valid JSON" in res["error"]["message"]
    got, res = _post(openai.url + "/v1/chat/completions", {"messages": []})
    assert got == 400 and res["error"]["param"] == "messages"
    import urllib.request

    with urllib.request.urlopen(openai.url + "/v1/models", timeout=30) as r:
        assert json.loads(r.read())["data"][0]["id"] == "dash"
    with urllib.request.urlopen(openai.url + "/health", timeout=30) as r:
        assert r.status == 200


# ------------------------------------------------------------------ prefix caching
def test_one_document_eight_questions_read_the_document_once(http, grpc, model):
    cfg = model.config
    doc = M.document_prompt([40, 25, 33], "", cfg, preamble="Contract 8812 ")
    questions = [
        "Who signed?",
        "What is the total?",
        "Title?",
        "Date of page 2?",
        "Summarise page 3.",
        "Currency?",
        "How many pages?",
        "Any table?",
    ]
    prompts = [doc + list(q.encode()) for q in questions]
    want = offline(model, prompts, [6] * 8)  # offline generation has no prefix cache
    before = http.stats()
    first = http.generate(prompts[0], 6)
    rest = [(grpc if i % 2 else http).generate(p, 6) for i, p in enumerate(prompts[1:])]
    assert [first.tokens] + [g.tokens for g in rest] == want
    shared = (len(doc) // ENGINE.kv_block_size) * ENGINE.kv_block_size
    assert first.cached_tokens == 0 and [g.cached_tokens for g in rest] == [shared] * 7
    after = http.stats()
    assert after["prompt_tokens_cached"] - before["prompt_tokens_cached"] == 7 * shared
    computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    assert computed == sum(map(len, prompts)) - 7 * shared  # each question after the first: its own tokens
    assert after["kv_blocks_reserved"] == 0 and after["kv_blocks_pinned"] == 0
    assert after["kv_blocks_free"] == ENGINE.num_blocks
