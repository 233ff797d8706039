"""A model that is not DashForCausalLM, end to end: examples/custom_decoder.py (its own names,
fused q/k/v with biases, LayerNorm, a GELU MLP, tied embeddings, a vision projection for image
features) through the model contract, a Hugging Face folder, dash-export and its ONNX Runtime
check, dash-compare, and the real Triton server on CPU answering like offline generation.
The commands are the ones docs/models.md shows."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest
import torch
from conftest import running_triton
from torch import nn

from dash_trt import model as M
from dash_trt.modeling import DashAttention, DashModel, ModelContractError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "custom_decoder.py")
CONFIG = os.path.join(ROOT, "examples", "custom_decoder.json")
SPEC = f"{EXAMPLE}:TinyOCRDecoder"


def lively(model: DashModel) -> DashModel:
    """Random weights whose greedy tokens depend on the context (and the image features):
    with tied embeddings and unscaled random blocks, the model copies its last token."""
    with torch.no_grad():
        model.wte.weight.mul_(0.05)
        for b in model.blocks:
            b.proj.weight.mul_(4.0)
            b.fc_out.weight.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def custom():
    return lively(M.random_model(M.load_model_config(CONFIG), model_class=SPEC, seed=0))


@pytest.fixture(scope="module")
def cases(custom):
    """Two prompts with image features, one with token embeddings."""
    cfg = custom.config
    prompts = [
        M.document_prompt([20, 12], "Doc 7:", cfg),
        M.document_prompt([36], "Title?", cfg, preamble="Q: "),
        M.document_prompt([18, 9], "Total:", cfg),
    ]
    gen = torch.Generator().manual_seed(1)
    feats = [torch.randn(32, 40, generator=gen), torch.randn(36, 40, generator=gen), None]
    return prompts, feats


@pytest.fixture(scope="module")
def folder(tmp_path_factory, custom):
    path = tmp_path_factory.mktemp("custom") / "hf"
    M.save_pretrained(custom, path)
    return path


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_the_example_follows_the_contract(custom):
    layers = custom.dash_layers()
    assert [m.layer_idx for m in layers] == [0, 1, 2] and type(custom).__name__ == "TinyOCRDecoder"
    assert custom.head.weight is custom.wte.weight and custom.takes_image_features
    assert custom.input_names() == (*M.MODEL_INPUTS, *M.IMAGE_INPUTS)


def test_paged_generation_equals_the_dense_reference(custom, cases):
    prompts, feats = cases
    ref = M.reference_generate(custom, prompts, 8, image_features=feats, stop_at_eos=False)
    for chunk in (None, 7):
        got = M.generate(custom, prompts, 8, image_features=feats, prefill_chunk=chunk, stop_at_eos=False)
        assert got.tokens == ref.tokens
        for a, b in zip(got.logits, ref.logits):
            torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)
    # not a degenerate model: tokens vary, and the features decide them
    assert len({t for seq in ref.tokens for t in seq}) >= 6
    plain = M.generate(custom, prompts[:1], 8, stop_at_eos=False).tokens[0]
    assert plain != ref.tokens[0]


def test_image_features_must_match_the_image_tokens(custom, cases):
    prompts, feats = cases
    with pytest.raises(ValueError, match="32 image tokens and 31 image feature rows"):
        M.generate(custom, prompts[:1], 2, image_features=[feats[0][:31]])
    with pytest.raises(ValueError, match=r"image features must be \[image tokens, 40\]"):
        M.generate(custom, prompts[:1], 2, image_features=[feats[0][:, :39]])
    with pytest.raises(ValueError, match="takes no image features"):
        M.generate(
            M.demo_model(), [M.document_prompt([3], "", M.demo_model().config)], 2, image_features=[torch.zeros(3, 128)]
        )


def test_hugging_face_folder_keeps_the_model_s_own_names(custom, folder):
    import safetensors.torch as st

    names = set(st.load_file(str(folder / "model.safetensors")))
    assert "wte.weight" in names and "blocks.0.qkv.bias" in names and "head.weight" not in names  # tied: once
    back = M.load_checkpoint(folder, model_class=SPEC)
    assert back.head.weight is back.wte.weight
    assert all(torch.equal(a, b) for a, b in zip(custom.state_dict().values(), back.state_dict().values()))
    assert M.load_model_config(folder / "config.json").architecture == "TinyOCRDecoder"


def test_sharded_folder_loads(custom, tmp_path):
    files = M.save_pretrained(custom, tmp_path / "sharded", max_shard_bytes=200_000)
    assert len([f for f in files if f.endswith(".safetensors")]) > 1
    back = M.load_checkpoint(tmp_path / "sharded", model_class=SPEC)
    assert all(torch.equal(a, b) for a, b in zip(custom.state_dict().values(), back.state_dict().values()))


def test_dash_export_and_dash_compare_take_the_model(folder, tmp_path):
    out = tmp_path / "custom.onnx"
    res = run_cli("dash_trt.export", str(folder), "--model", SPEC, "--out", str(out), "--quiet")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "the checker and ONNX Runtime agree with PyTorch" in res.stdout
    import onnx

    graph = onnx.load(str(out), load_external_data=False).graph
    assert [i.name for i in graph.input][7:9] == list(M.IMAGE_INPUTS)
    assert sum(n.op_type == "DashAttention" for n in graph.node) == 3
    feeds = tmp_path / "in.json"
    res = run_cli(
        "dash_trt.compare",
        str(out),
        "--checkpoint",
        str(folder),
        "--model",
        SPEC,
        "--no-cuda",
        "--save-inputs",
        str(feeds),
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "all backends match the reference" in res.stdout
    # polygraphy's linter on the export, fed what dash-compare saved (README, "Check an export")
    lint = subprocess.run(
        [sys.executable, "-c", "import sys; from polygraphy.tools import main; sys.exit(main())", "check", "lint"]
        + [str(out), "--load-inputs", str(feeds)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert lint.returncode == 0 and "PASSED" in lint.stdout + lint.stderr, lint.stdout[-2000:] + lint.stderr[-2000:]


def test_onnx_runtime_generates_the_pytorch_tokens_with_image_features(custom, cases, tmp_path):
    """Generation driven by ONNX Runtime alone (its logits choose the tokens, its caches are
    threaded step to step) gives PyTorch's tokens, image-feature prompts included."""
    from dash_trt import export as E

    path = tmp_path / "m.onnx"
    E.export_onnx(custom, path)
    sess = E._ort_session(str(path))
    names = [i.name for i in sess.get_inputs()]
    state: dict = {}

    def ort_forward(inputs: dict, caches: list):
        past = state.get("caches") or [E.to_numpy(c) for c in caches]
        res = sess.run(None, dict(zip(names, [E.to_numpy(v) for v in inputs.values()] + past)))
        state["caches"] = res[1:]
        return E.to_torch(res[0]), [E.to_torch(a) for a in res[1:]]

    prompts, feats = cases
    want = M.generate(custom, prompts, 8, image_features=feats, prefill_chunk=40, stop_at_eos=False).tokens
    got = M.generate(
        custom, prompts, 8, image_features=feats, prefill_chunk=40, stop_at_eos=False, forward=ort_forward
    ).tokens
    assert got == want


def test_export_without_the_class_says_how_to_name_it(folder, tmp_path):
    res = run_cli("dash_trt.export", str(folder), "--out", str(tmp_path / "x.onnx"), "--quiet")
    assert res.returncode == 2
    assert re.search(r"architecture 'TinyOCRDecoder'.*--model module:Class", res.stderr), res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = run_cli("dash_trt.export", str(folder), "--model", "no_such_module:Model", "--out", str(tmp_path / "x.onnx"))
    assert res.returncode == 2 and "cannot import no_such_module" in res.stderr and "Traceback" not in res.stderr


class _MissingLayer(DashModel):
    """Calls only layer 0 of two."""

    def __init__(self, config):
        super().__init__(config)
        self.emb = nn.Embedding(config.vocab_size, config.hidden_size)
        self.attn = nn.ModuleList(DashAttention(config, i) for i in range(config.num_hidden_layers))
        self.q = nn.Linear(config.hidden_size, config.num_attention_heads * config.head_dim)
        self.kv = nn.Linear(config.hidden_size, config.num_key_value_heads * config.head_dim)
        self.i = nn.Linear(config.hidden_size, config.index_head_dim)
        self.w = nn.Parameter(torch.ones(config.index_head_dim))
        self.out = nn.Linear(config.num_attention_heads * config.head_dim, config.vocab_size)

    def embed_input_ids(self, ids):
        return self.emb(ids)

    def forward(self, x, dash):
        c, t = self.config, x.shape[0]
        kv = self.kv(x).view(t, c.num_key_value_heads, c.head_dim)
        return self.attn[0](
            self.q(x).view(t, c.num_attention_heads, c.head_dim), kv, kv, self.i(x), self.i(x), self.w, dash
        ).reshape(t, -1)

    def compute_logits(self, hidden):
        return self.out(hidden)


def test_contract_errors_name_what_is_wrong():
    cfg = M.DashModelConfig.from_dict(M.DEMO_CONFIG)
    broken = M.random_model(cfg, model_class=_MissingLayer)
    prompt = M.document_prompt([3], "", cfg)
    with pytest.raises(ModelContractError, match=r"never called DashAttention layer\(s\) \[1\]"):
        broken.reference_logits(prompt)
    with pytest.raises(ModelContractError, match="not a dash_trt.modeling.DashModel subclass"):
        M.resolve_model_class(nn.Linear)
    broken.extra = DashAttention(cfg, 0)  # a second module for layer 0
    with pytest.raises(ModelContractError, match=r"layer indices \[0, 0, 1\]"):
        broken.dash_layers()
    with pytest.raises(ModelContractError, match=r"q is \[4, 3, 32\], expected \[4, 4, 32\]"):
        DashAttention(cfg, 0)(
            torch.zeros(4, 3, 32),
            torch.zeros(4, 2, 32),
            torch.zeros(4, 2, 32),
            torch.zeros(4, 32),
            torch.zeros(4, 32),
            torch.zeros(32),
            _reference_context(cfg, 4),
        )


def _reference_context(cfg, t):
    from dash_trt.modeling import DashContext

    return DashContext.reference(M.token_roles([0] * t, cfg), None, cfg.num_hidden_layers)


def test_demo_model_takes_image_features_of_its_hidden_size():
    cfg = M.DashModelConfig.from_dict({**M.DEMO_CONFIG, "image_feature_dim": 128})
    demo = M.random_model(cfg, seed=1)
    prompt = M.document_prompt([20], "Q", cfg)
    feats = [torch.randn(20, 128, generator=torch.Generator().manual_seed(0))]
    got = M.generate(demo, [prompt], 4, image_features=feats, prefill_chunk=9, stop_at_eos=False)
    ref = M.reference_generate(demo, [prompt], 4, image_features=feats, stop_at_eos=False)
    assert got.tokens == ref.tokens
    torch.testing.assert_close(got.logits[0], ref.logits[0], atol=2e-4, rtol=2e-4)


# ------------------------------------------------------------------ served by Triton
@pytest.mark.triton
def test_triton_serves_the_custom_model_like_offline_generation(custom, folder, cases, tmp_path):
    from dash_trt.triton import client as C

    repo = tmp_path / "repo"
    res = run_cli(
        "dash_trt.triton.cli",
        "write",
        str(folder),
        "--model",
        SPEC,
        "--out",
        str(repo),
        "--num-blocks",
        "64",
        "--torch-threads",
        "1",
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert (repo / "dash" / "1" / "custom_decoder.py").is_file()  # the repository carries the model's code
    prompts, feats = cases
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = [
            M.generate(custom, [p], 8, image_features=[f], stop_at_eos=False).tokens[0] for p, f in zip(prompts, feats)
        ]
    finally:
        torch.set_num_threads(threads)
    with running_triton(repo, tmp_path / "tritonserver.log") as srv:
        with C.DashClient(srv.http_url, protocol="http") as http, C.DashClient(srv.grpc_url, protocol="grpc") as grpc:
            assert http.model_config() == custom.config
            for p, f, w in zip(prompts, feats, want):
                arr = None if f is None else f.numpy()
                assert http.generate(p, 8, stop_at_eos=False, image_features=arr).tokens == w
                assert grpc.stream(p, 8, stop_at_eos=False, image_features=arr).tokens == w
            with pytest.raises(C.DashClientError, match="31 rows, the prompt has 32 <image> tokens") as err:
                http.generate(prompts[0], 4, image_features=feats[0].numpy()[:31])
            assert err.value.status in ("400", "StatusCode.INVALID_ARGUMENT")
            stats = http.stats()
            assert stats["kv_blocks_free"] == stats["kv_blocks_total"] and stats["kv_blocks_reserved"] == 0


def test_guide_shows_the_example_and_the_commands_this_test_runs():
    with open(os.path.join(ROOT, "docs", "models.md"), encoding="utf-8") as fh:
        guide = fh.read()
    with open(EXAMPLE, encoding="utf-8") as fh:
        code = fh.read()
    blocks = re.findall(r"```python\n(.*?)```", guide, re.S)
    assert code in blocks, "docs/models.md must show examples/custom_decoder.py verbatim"
    for command in (
        "dash-export hf --model examples/custom_decoder.py:TinyOCRDecoder --out custom.onnx",
        "dash-compare custom.onnx --checkpoint hf --model examples/custom_decoder.py:TinyOCRDecoder",
        "dash-triton write hf --model examples/custom_decoder.py:TinyOCRDecoder --out repo",
    ):
        assert command in guide


def _cuda_kernels() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (none visible to torch)"
    from dash_trt.attention.dash import cuda as dcuda

    return None if dcuda.available() else "the kernel library is not built"


@pytest.mark.skipif(_cuda_kernels() is not None, reason=str(_cuda_kernels()))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_custom_model_on_the_cuda_kernels(dtype):
    """The example at kernel sizes (head dim 64) on the GPU: the serving runtime (kernels,
    image features in the eager prefill, decode from CUDA graphs) against the dense reference
    of the same weights on the GPU."""
    from dash_trt.serving.runner import PagedRuntime

    base = M.load_model_config(CONFIG)
    cfg = base.replace(
        head_dim=64,
        num_attention_heads=4,
        hidden_size=256,
        intermediate_size=512,
        dash=dataclasses.replace(base.dash, sparse_index_dim=64),
    )
    model = lively(M.random_model(cfg, model_class=SPEC, seed=3, dtype=dtype, device="cuda"))
    prompts = [M.document_prompt([40, 24], "Total:", cfg), M.document_prompt([70], "Title?", cfg)]
    gen = torch.Generator().manual_seed(5)
    feats = [torch.randn(64, 40, generator=gen), None]
    runtime = PagedRuntime(model, 64, 16, max_model_len=256, max_num_seqs=2)
    assert runtime.kernels, runtime.kernels_reason
    got = M.generate(model, prompts, 12, image_features=feats, prefill_chunk=48, stop_at_eos=False)
    assert got.graph_steps > 0  # decode steps replayed from CUDA graphs
    eager = M.generate(model, prompts, 12, image_features=feats, prefill_chunk=48, stop_at_eos=False, cuda_graphs=False)
    assert eager.graph_steps == 0 and eager.tokens == got.tokens  # graphs replay the eager steps
    for a, b in zip(got.logits, eager.logits):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # the prefill (its image features included) against the dense reference: the first token
    ref = M.reference_generate(model, prompts, 1, image_features=feats, stop_at_eos=False)
    for g, r, gl, rl in zip(got.tokens, ref.tokens, got.logits, ref.logits):
        err = (gl[0] - rl[0]).abs().max().item()
        assert err < 0.1 * max(1.0, rl[0].abs().max().item()), err
        top2 = rl[0].topk(2).values
        assert g[0] == r[0] or (top2[0] - top2[1]).item() < 2 * err


def test_float32_features_feed_a_bfloat16_model(custom, cases):
    """Features arrive as float32 (the Triton input, a vision encoder's output) whatever the
    model's dtype: every path casts them to it."""
    prompts, feats = cases
    half = M.random_model(custom.config, model_class=SPEC, seed=0, dtype=torch.bfloat16)
    ref = half.reference_logits(prompts[0], len(prompts[0]), feats[0])
    got = M.generate(half, prompts[:1], 1, image_features=feats[:1]).logits[0][0]
    assert ref.dtype == torch.float32 and torch.isfinite(ref).all()
    assert (got - ref[-1]).abs().max().item() < 0.1 * max(1.0, ref[-1].abs().max().item())
