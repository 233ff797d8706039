"""vLLM 0.34.0's own DASH path, loaded for the benchmark from files of its wheel (never a
dependency of dash-trt, never committed).

:func:`load` imports the wheel's two DASH modules, ``vllm/model_executor/layers/dash_attention.py``
(``page_coordinates``, ``page_rope``, ``route_blocks``, ``prompt_page_positions``) and
``vllm/v1/attention/ops/dash_attention.py`` (the Triton coordinate, write, score and gather
kernels, ``paged_dash_prefill``, ``paged_dash_decode``, ``flash_dash_attention``), from an
unpacked tree (``ROOT/vllm/...``: unzip the wheel, or keep just those files). The rest of vLLM
that their imports name is replaced by small stand-ins (the serving framework's classes the
modules only subclass, ``vllm.triton_utils`` as the installed Triton, which is what it
re-exports when Triton is present). Nothing of vLLM's arithmetic is replaced.

Segment attention (``flash_dash_attention``'s ``FLASH_ATTN`` branch) runs on vLLM's own
FlashAttention 3 library when ``ROOT/vllm/vllm_flash_attn`` holds it and it loads against the
installed torch (vLLM picks FA3 on compute capability 9.x, as here). When it does not load,
:func:`load` says why and the same call goes to PyTorch's FlashAttention-2
(``aten::_flash_attention_forward``: varlen, each segment's used length as ``seqused_k``),
named ``FA2 (PyTorch)`` in the results.

:class:`VllmCaches` holds vLLM's paged KV layout (per layer ``[blocks, kv_heads + 1, block,
2 * head_dim]``: keys and values, then one auxiliary head of index keys, roles, page state
and cached summaries, as ``paged_dash_prefill``/``paged_dash_decode`` write it) and
:class:`VllmContext` is a :class:`dash_trt.modeling.DashContext` whose ``attend`` calls those
two functions, so the benchmark's model runs every layer's attention through vLLM's code.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import sys
import types

import torch

from dash_trt.modeling import PAGED, DashContext

_STUBS = (
    "vllm",
    "vllm.compilation",
    "vllm.compilation.breakable_cudagraph",
    "vllm.forward_context",
    "vllm.model_executor",
    "vllm.model_executor.layers",
    "vllm.model_executor.layers.attention",
    "vllm.model_executor.layers.attention.rswa_attention",
    "vllm.model_executor.layers.linear",
    "vllm.triton_utils",
    "vllm.platforms",
    "vllm.v1",
    "vllm.v1.attention",
    "vllm.v1.attention.backend",
    "vllm.v1.attention.backends",
    "vllm.v1.attention.backends.fa_utils",
    "vllm.v1.attention.backends.triton_attn",
    "vllm.v1.attention.ops",
    "vllm.vllm_flash_attn",
)


class VllmPeerError(RuntimeError):
    pass


def _module(name: str, root: str) -> types.ModuleType:
    m = types.ModuleType(name)
    path = os.path.join(root, *name.split("."))
    if os.path.isdir(path):
        m.__path__ = [path]  # a package: its real files import from here
    sys.modules[name] = m
    return m


def load(root: str) -> types.SimpleNamespace:
    """vLLM's DASH modules from the unpacked tree ``root`` (module docstring). Returns
    ``ns.layers`` (the layer module), ``ns.ops`` (the ops module) and ``ns.segments``, the name
    of what computes the attention of the gathered segments."""
    for rel in ("model_executor/layers/dash_attention.py", "v1/attention/ops/dash_attention.py"):
        if not os.path.isfile(os.path.join(root, "vllm", rel)):
            raise VllmPeerError(f"{root}/vllm/{rel} is missing: unpack vLLM 0.34.0's wheel there")
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]
    mods = {name: _module(name, root) for name in _STUBS}
    import triton
    import triton.language as tl

    mods["vllm.triton_utils"].triton, mods["vllm.triton_utils"].tl = triton, tl
    if os.environ.get("TRITON_INTERPRET") == "1":
        # Triton's CPU interpreter (the adapter's CPU check) has no libdevice: its cos and sin
        # are numpy's either way.
        from triton.language.extra.cuda import libdevice

        libdevice.cos = lambda x: tl.cos(x)  # looked up when run: the interpreter's own
        libdevice.sin = lambda x: tl.sin(x)
    mods["vllm.compilation.breakable_cudagraph"].eager_break_during_capture = lambda fn: fn

    def no_context():
        raise VllmPeerError("vLLM's forward context is not used by the benchmark")

    mods["vllm.forward_context"].get_forward_context = no_context
    # Classes the layer module subclasses or names at import time; the benchmark never builds them.
    for mod, names in (
        ("vllm.model_executor.layers.attention", ("Attention",)),
        ("vllm.model_executor.layers.attention.rswa_attention", ("RSWAAttention",)),
        ("vllm.model_executor.layers.linear", ("QKVParallelLinear", "RowParallelLinear")),
        ("vllm.v1.attention.backend", ("CommonAttentionMetadata",)),
        ("vllm.v1.attention.backends.triton_attn", ("TritonAttentionBackend", "TritonAttentionMetadataBuilder")),
    ):
        for n in names:
            setattr(mods[mod], n, type(n, (), {}))
    mods["vllm.v1.attention.backends.triton_attn"].TritonAttentionMetadata = dataclasses.make_dataclass(
        "TritonAttentionMetadata", []
    )

    class _Platform:  # what the FlashAttention interface asks of vLLM's platform
        @staticmethod
        def get_device_capability():
            major, minor = torch.cuda.get_device_capability()
            return types.SimpleNamespace(major=major, minor=minor)

        @staticmethod
        def has_device_capability(cap: int) -> bool:
            major, minor = torch.cuda.get_device_capability()
            return major * 10 + minor >= cap

        @staticmethod
        def is_device_capability_family(cap: int) -> bool:
            return torch.cuda.get_device_capability()[0] * 10 == cap

    mods["vllm.platforms"].current_platform = _Platform()
    segments, why = _flash_attention(root, mods)
    layers = importlib.import_module("vllm.model_executor.layers.dash_attention")
    ops = importlib.import_module("vllm.v1.attention.ops.dash_attention")
    fa3 = None
    if why is None:  # the library itself, for the dense FA3 peer
        fa3 = importlib.import_module("vllm.vllm_flash_attn.flash_attn_interface").flash_attn_varlen_func
    return types.SimpleNamespace(layers=layers, ops=ops, segments=segments, fa_unavailable=why, fa3=fa3)


def _flash_attention(root: str, mods: dict) -> tuple[str, str | None]:
    """Point ``flash_dash_attention``'s imports at vLLM's FA3, or at PyTorch's FA2 when FA3 does
    not load. Returns the name of what runs and, for the fallback, why."""
    fa_utils = mods["vllm.v1.attention.backends.fa_utils"]
    why = None
    try:
        iface = importlib.import_module("vllm.vllm_flash_attn.flash_attn_interface")
        if not iface.is_fa_version_supported(3):
            why = iface.fa_version_unsupported_reason(3)
    except Exception as exc:  # noqa: BLE001 - any failure to load means: use the fallback
        why = f"{type(exc).__name__}: {exc}"
    if why is None:
        fa_utils.get_flash_attn_version = lambda **_: 3  # vLLM's choice on compute capability 9.x
        return "vLLM FA3", None
    # NOTE: the fallback takes the FA4 branch of flash_dash_attention (contiguous segments with
    # cu_seqlens_k and seqused_k, no block table), which is what PyTorch's varlen FA2 accepts.
    fa_utils.get_flash_attn_version = lambda **_: 4
    iface = types.ModuleType("vllm.vllm_flash_attn.flash_attn_interface")
    iface.flash_attn_varlen_func = _torch_fa2_varlen
    sys.modules[iface.__name__] = iface
    return "FA2 (PyTorch)", why


def _torch_fa2_varlen(
    q,
    k,
    v,
    *,
    max_seqlen_q,
    cu_seqlens_q,
    max_seqlen_k,
    cu_seqlens_k,
    seqused_k,
    block_table,
    softmax_scale,
    causal,
    return_softmax_lse,
    fa_version,
):
    """``flash_attn_varlen_func``'s call in ``flash_dash_attention`` on PyTorch's FA2. Returns
    ``(out [Nq, H, D], lse [H, Nq])`` like vLLM's (which the caller transposes)."""
    if block_table is not None or not return_softmax_lse:
        raise VllmPeerError("the PyTorch fallback takes contiguous segments with their log-sum-exp")
    if not q.is_cuda:  # the adapter's CPU check (Triton's interpreter): the same sums, in float32
        return _math_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, softmax_scale)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k.to(torch.int32),
        max_seqlen_q,
        max_seqlen_k,
        0.0,
        causal,
        False,
        scale=softmax_scale,
        seqused_k=seqused_k.clamp_min(1),  # an empty segment's result is masked by the caller
    )
    return out, lse


def _math_varlen(q, k, v, cu_q, cu_k, used, scale):
    """Varlen attention of one query row per segment (what ``flash_dash_attention`` asks), in
    float32 on any device: ``(out [Nq, H, D], lse [H, Nq])``."""
    n, h, d = q.shape
    g = h // k.shape[1]
    out = torch.zeros(n, h, d, dtype=q.dtype, device=q.device)
    lse = torch.full((h, n), -float("inf"), dtype=torch.float32, device=q.device)
    for i in range(n):
        assert int(cu_q[i + 1]) - int(cu_q[i]) == 1
        m = int(used[i])
        if m == 0:
            continue
        kk = k[int(cu_k[i]) : int(cu_k[i]) + m].float().repeat_interleave(g, 1)  # [m, H, D]
        vv = v[int(cu_k[i]) : int(cu_k[i]) + m].float().repeat_interleave(g, 1)
        logits = torch.einsum("hd,mhd->hm", q[int(cu_q[i])].float(), kk) * scale
        lse[:, i] = torch.logsumexp(logits, -1)
        out[i] = torch.einsum("hm,mhd->hd", logits.softmax(-1), vv).to(q.dtype)
    return out, lse


# ------------------------------------------------------------------ the caches and the context
class VllmCaches:
    """vLLM's DASH KV layout for every layer of a model, with a contiguous run of blocks per
    sequence slot (slot ``i`` owns blocks ``[i * width, (i + 1) * width)``)."""

    def __init__(self, model, slots: int, max_len: int, block: int = 16):
        c = model.config
        self.block = block
        self.width = -(-max_len // block)
        self.max_len = self.width * block
        shape = (slots * self.width, c.num_key_value_heads + 1, block, 2 * c.head_dim)
        self.layers = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(c.num_hidden_layers)]
        self.tables = torch.arange(slots * self.width, dtype=torch.int32, device=model.device).view(slots, self.width)

    def slots_of(self, seq: int, start: int, end: int) -> torch.Tensor:
        """Physical slot indices of positions ``start:end`` of sequence slot ``seq``."""
        pos = torch.arange(start, end, device=self.tables.device)
        return (seq * self.width + pos // self.block) * self.block + pos % self.block

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)


class VllmContext(DashContext):
    """One forward pass whose DASH layers run vLLM's paged prefill or decode (module docstring).

    Prefill: one sequence's chunk, ``step = dict(kind="prefill", seq, roles [n], positions [4, n],
    length, prompt_len)``; decode: ``step = dict(kind="decode", roles [B], seq_lens [B],
    slots [B], positions [4, B], prefix_lens [B], tables [B, W])``, every tensor on the device
    (the decode form is what a CUDA graph captures)."""

    def __init__(self, vllm, caches: VllmCaches, sp: dict, max_model_len: int, step: dict, num_layers: int):
        super().__init__(PAGED, num_layers)
        self.vllm, self.vc, self.sp, self.max_model_len, self.step = vllm, caches, sp, max_model_len, step

    def attend(self, module, q, k, v, iq, ik, head_cls):
        i = module.layer_idx
        self.called[i] = True
        s, ops = self.step, self.vllm.ops
        cache = self.vc.layers[i]
        if s["kind"] == "prefill":
            seq = s["seq"]
            n = q.shape[0]
            return ops.paged_dash_prefill(
                q,
                k,
                v,
                iq,
                ik,
                s["roles"],
                s["positions"],
                cache,
                self.vc.tables[seq : seq + 1],
                s["length"],
                self.vc.slots_of(seq, s["length"] - n, s["length"]),
                head_cls,
                self.sp,
                i,
                "FLASH_ATTN",
                prefix_lens=s["prefix_lens"],
            )
        return ops.paged_dash_decode(
            q,
            k,
            v,
            iq,
            ik,
            s["roles"],
            cache,
            s["tables"],
            s["seq_lens"],
            s["slots"],
            head_cls,
            self.sp,
            i,
            self.max_model_len,
            s["prefix_lens"],
            backend="FLASH_ATTN",
            cached_summaries=True,
            positions=s["positions"],
        )


def load_from(path: str) -> types.SimpleNamespace:
    """:func:`load` from a folder, or from a ``.tar.xz``/``.tar.gz`` of one (unpacked beside it
    once)."""
    if os.path.isdir(path):
        return load(path)
    if not os.path.isfile(path):
        raise VllmPeerError(f"{path}: no such file or folder (vLLM 0.34.0's DASH files)")
    import tarfile

    dest = path + ".d"
    if not os.path.isdir(os.path.join(dest, "vllm")):
        with tarfile.open(path) as tf:
            tf.extractall(dest, filter="data")
    return load(dest)


def have_spec(name: str) -> bool:
    return importlib.util.find_spec(name) is not None
