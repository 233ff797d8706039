"""PyTorch binding of the DASH CUDA kernels (the C ABI in plugins/include/dash/dash.h).

The kernels live in a plain shared library, ``libdash_trt_kernels.so``, with an ``extern "C"``
launcher over one parameter struct. Binding it through ctypes (rather than a torch C++
extension) keeps one compiled artefact for every front end (PyTorch, the TensorRT plugin,
tests) and ties it to no torch version. The launch goes on torch's current stream, allocates
nothing itself and never synchronises, so it can be captured in a CUDA graph.

Library search order: ``$DASH_TRT_LIBRARY``; ``dash_trt/lib/`` inside the installed package
(wheels built by ``pip install .`` with a CUDA compiler); ``build*/`` folders of a source
checkout.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path

import torch

from ...libraries import installed_paths
from ...versions import KERNEL_ABI_VERSION
from .config import as_config
from .paged import BATCH_FIELDS, CACHE_FIELDS, TOKEN_FIELDS, OperatorCall, paged_dash_attention
from .reference import FLOAT_DTYPES, Routing, SpLike, check_heads, check_shape

__all__ = [
    "DashKernelsNotFound",
    "DashKernelError",
    "LIBRARY_NAME",
    "available",
    "library_path",
    "supported_head_dims",
    "paged_dash_attention_cuda",
    "supports",
    "check_sizes",
    "Tuning",
]

LIBRARY_NAME = "libdash_trt_kernels.so"
ABI_VERSION = KERNEL_ABI_VERSION
#: Routing rules a kernel library reports (``DASH_ROUTING_*``, plugins/include/dash/params.h);
#: this binding loads only a library that routes by the function's, Unlimited-OCR-2's.
ROUTING_WITHDRAWN, ROUTING_UNLIMITED_OCR2 = 1, 2
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_STATUS_OK = 0
DATA_ERRORS = {
    1: "a block-table entry is outside the cache",
    2: "seq_lens/query_start_loc are inconsistent or exceed the block table",
}


#: Why the kernels refuse an fp8 cache (no ``DASH_ERR_UNSUPPORTED``: no silent fallback either).
FP8_UNSUPPORTED = (
    "the DASH CUDA kernels do not support an fp8 KV cache (kv_cache_dtype='fp8_e4m3') yet: they would "
    "read its e4m3 bytes as the model dtype. Use a cache in the model dtype, or the PyTorch paged "
    "operator (dash_trt.attention.dash.paged.paged_dash_attention), which defines the fp8 semantics"
)


class DashKernelsNotFound(RuntimeError):
    """The compiled kernel library is not available."""


class DashKernelError(RuntimeError):
    """The kernel library refused the call or a launch failed."""


#: ``dash_params_field`` type codes (plugins/include/dash/dash.h) as ctypes types.
_FIELD_TYPES = {0: ctypes.c_int32, 1: ctypes.c_float, 2: ctypes.c_void_p, 3: ctypes.c_uint64}
#: ``DashParamGroup`` (plugins/include/dash/params.h) by name.
FIELD_GROUPS = ("SIZE", "CONFIG", "INPUT", "CACHE", "OUTPUT", "SCRATCH", "DEBUG", "TUNE")


def _params_layout(lib: ctypes.CDLL, path) -> tuple[type[ctypes.Structure], dict[str, str]]:
    """The ctypes mirror of ``DashParams`` built from the library's own field table
    (``dash_params_field``, generated from plugins/include/dash/params.def), checked against its
    size and offsets, and each field's group."""
    lib.dash_params_field.restype = ctypes.c_int32
    lib.dash_params_field.argtypes = [
        ctypes.c_int32,
        ctypes.POINTER(ctypes.c_char_p),
        ctypes.POINTER(ctypes.c_int32),
        ctypes.POINTER(ctypes.c_int64),
        ctypes.POINTER(ctypes.c_int32),
    ]
    rows, groups = [], {}
    for i in range(lib.dash_params_field(0, None, None, None, None)):
        name, kind, offset, group = ctypes.c_char_p(), ctypes.c_int32(), ctypes.c_int64(), ctypes.c_int32()
        lib.dash_params_field(i, ctypes.byref(name), ctypes.byref(kind), ctypes.byref(offset), ctypes.byref(group))
        if kind.value not in _FIELD_TYPES or not 0 <= group.value < len(FIELD_GROUPS):
            raise DashKernelError(f"{path}: DashParams field {i} has type {kind.value}, group {group.value}")
        rows.append((name.value.decode(), _FIELD_TYPES[kind.value], offset.value))
        groups[rows[-1][0]] = FIELD_GROUPS[group.value]
    mirror = type(
        "DashParams",
        (ctypes.Structure,),
        {
            "_fields_": [(n, t) for n, t, _ in rows],
            "__doc__": "ctypes mirror of DashParams, built from the kernel library's field table.",
        },
    )
    if ctypes.sizeof(mirror) != lib.dash_params_size():
        raise DashKernelError(
            f"{path}: DashParams is {lib.dash_params_size()} bytes, its fields make {ctypes.sizeof(mirror)}"
        )
    for name, _, offset in rows:
        if getattr(mirror, name).offset != offset:
            laid = getattr(mirror, name).offset
            raise DashKernelError(f"{path}: DashParams.{name} at offset {offset}, ctypes lays it at {laid}")
    written = {
        "SIZE": set(_SIZE_FIELDS),
        "CONFIG": set(_CONFIG_FIELDS),
        "INPUT": set(_INPUT_FIELDS),
        "CACHE": {f"{name}_cache" for name in CACHE_FIELDS},
        "OUTPUT": {"out"},
        "SCRATCH": {"workspace", "workspace_size"},
        "DEBUG": {"selected_out", "bias_out"},
        "TUNE": set(Tuning().params()),
    }
    for group, names in written.items():
        have = {n for n, g in groups.items() if g == group}
        # every field the binding writes exists; every size, configuration, input, cache and
        # output field of the library is written (scratch, debug and tuning fields may stay 0)
        if names - have or (group not in ("SCRATCH", "DEBUG", "TUNE") and have - names):
            raise DashKernelError(
                f"{path}: DashParams {group} fields are {sorted(have)}, this binding writes {sorted(names)}"
            )
    return mirror, groups


class DashPlan(ctypes.Structure):
    """ctypes mirror of ``DashPlan`` (dash.h): opaque, filled by ``dash_plan``."""

    _fields_ = [("opaque", ctypes.c_uint64 * 96)]


@dataclass(frozen=True)
class Tuning:
    """The kernels' tuning knobs (``DashParams.tune_*``, plugins/include/dash/params.h); 0 takes
    the library's documented default. Tests and benchmarks pass others explicitly; the
    library reads no environment variable."""

    block_major_min_tokens: int = 0  #: prefill attention goes block-major from this many tokens (1024; < 0: never)
    block_major_chunk: int = 0  #: tokens per block-major pass (16384)
    attend_ctas: int = 0  #: split-K target (CTAs) of the token-major attention (256)
    fused_front: int = 0  #: decode-only calls fold the write and summary stages into later launches (< 0: no)
    front_writer: int = 0  #: the folded write: 0 the plan picks, 1 a CTA of its own, 2 the first routing CTA
    #: block-major prefill: a tile reads a block query-major when this many of its tokens select it
    #: (5/8 of the tile; < 0: never, every entry goes block-major)
    tile_share_min: int = 0
    #: block-major prefill on an sm_90 GPU (a build for architecture 90a, head dim 128): the tiles as
    #: warpgroup MMAs (0: both tile kinds; 1: the block-major tiles only; 2: the query-major tiles
    #: only; < 0: the mma.sync tiles everywhere)
    warpgroup_mma: int = 0
    #: where the block-major tiles are warpgroup MMAs: warpgroups per CTA, sharing one block's keys
    #: and values (0: the plan picks by the rows a block can expect per pass; 1; 2; others are refused)
    block_major_warpgroups: int = 0
    #: block-major tiles: CTAs per KV head (0: one a work item; > 0: that many, at most one a work
    #: item, each serving work items in turn; < 0 is refused)
    block_major_ctas: int = 0
    #: block-major prefill on sm_90 and later GPUs: the query-major tiles start while the
    #: block-major tiles finish (programmatic dependent launch; 0: yes; < 0: no)
    tile_overlap: int = 0

    def params(self) -> dict[str, int]:
        return {f"tune_{f.name}": int(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def parse(cls, text: str) -> Tuning:
        """``"name=value,name=value"`` (the field names above), for benchmark command lines."""
        values = {}
        for item in filter(None, (x.strip() for x in text.split(","))):
            name, _, value = item.partition("=")
            if name not in {f.name for f in fields(cls)}:
                raise ValueError(f"unknown tuning knob {name!r} (known: {', '.join(f.name for f in fields(cls))})")
            values[name] = int(value)
        return cls(**values)


def _candidates() -> list[Path]:
    env = os.environ.get("DASH_TRT_LIBRARY")
    return [Path(env)] if env else installed_paths(LIBRARY_NAME)


def library_path() -> Path | None:
    """Where the kernel library would be loaded from, or None."""
    for path in _candidates():
        if path.is_file():
            return path
    return None


@lru_cache(maxsize=1)
def _loaded() -> tuple[ctypes.CDLL, type[ctypes.Structure]]:
    """The kernel library, its ABI checked, and the ctypes mirror of its ``DashParams``."""
    path = library_path()
    if path is None:
        raise DashKernelsNotFound(
            f"{LIBRARY_NAME} not found (looked at: {', '.join(map(str, _candidates()))}). Build it with "
            "'pip install .' on a machine with a CUDA compiler, or 'cmake -B build && cmake --build build', "
            "or point DASH_TRT_LIBRARY at it."
        )
    lib = ctypes.CDLL(str(path))
    lib.dash_params_size.restype = ctypes.c_size_t
    lib.dash_params_offset.restype = ctypes.c_int64
    lib.dash_params_offset.argtypes = [ctypes.c_char_p]
    lib.dash_supported_head_dims.restype = ctypes.c_int32
    lib.dash_supported_head_dims.argtypes = [ctypes.POINTER(ctypes.c_int32), ctypes.c_int32]
    lib.dash_abi_version.restype = ctypes.c_int32
    if lib.dash_abi_version() != ABI_VERSION:
        raise DashKernelError(f"{path}: ABI version {lib.dash_abi_version()}, this package expects {ABI_VERSION}")
    lib.dash_routing_rule.restype = ctypes.c_int32
    if lib.dash_routing_rule() != ROUTING_UNLIMITED_OCR2:
        raise DashKernelError(f"{path}: routes by rule {lib.dash_routing_rule()}, not Unlimited-OCR-2's")
    DashParams, _ = _params_layout(lib, path)
    lib.dash_max_selected.restype = ctypes.c_int32
    lib.dash_max_selected.argtypes = [ctypes.POINTER(DashParams)]
    lib.dash_workspace_size.restype = ctypes.c_int
    lib.dash_workspace_size.argtypes = [ctypes.POINTER(DashParams), ctypes.POINTER(ctypes.c_size_t)]
    lib.dash_run.restype = ctypes.c_int
    lib.dash_run.argtypes = [ctypes.POINTER(DashParams), ctypes.c_void_p]
    lib.dash_plan.restype = ctypes.c_int
    lib.dash_plan.argtypes = [ctypes.POINTER(DashParams), ctypes.POINTER(DashPlan)]
    lib.dash_plan_workspace_size.restype = ctypes.c_size_t
    lib.dash_plan_workspace_size.argtypes = [ctypes.POINTER(DashPlan)]
    lib.dash_run_plan.restype = ctypes.c_int
    lib.dash_run_plan.argtypes = [ctypes.POINTER(DashParams), ctypes.POINTER(DashPlan), ctypes.c_void_p]
    lib.dash_read_data_errors.restype = ctypes.c_int
    lib.dash_read_data_errors.argtypes = [ctypes.POINTER(DashParams), ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32)]
    lib.dash_status_string.restype = ctypes.c_char_p
    lib.dash_status_string.argtypes = [ctypes.c_int]
    lib.dash_last_error_message.restype = ctypes.c_char_p
    return lib, DashParams


def _library() -> ctypes.CDLL:
    return _loaded()[0]


def _mirror() -> type[ctypes.Structure]:
    """The ctypes ``DashParams`` of the loaded library (:func:`_params_layout`)."""
    return _loaded()[1]


def __getattr__(name: str):
    if name == "DashParams":  # built from the library's field table when it is first loaded
        return _mirror()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def routing_rule() -> int:
    """The routing rule the kernel library implements (:data:`ROUTING_UNLIMITED_OCR2`, the
    function's: a library reporting another is not loaded)."""
    lib = _library()
    lib.dash_routing_rule.restype = ctypes.c_int32
    return int(lib.dash_routing_rule())


def available() -> bool:
    """True when the kernel library loads and a CUDA device is visible."""
    if not torch.cuda.is_available():
        return False
    try:
        _library()
    except (DashKernelsNotFound, DashKernelError, OSError):
        return False
    return True


def compiled_architectures() -> tuple[str, ...] | None:
    """The GPU code the kernel library carries, as torch.cuda.get_arch_list() names it:
    ``("sm_80", "sm_89", "sm_90a", "compute_90")`` for machine code of three architectures
    (Hopper's architecture-specific, with its warpgroup MMA tiles) and PTX that newer GPUs
    JIT-compile; None for a library older than the query."""
    lib = _library()
    try:
        fn = lib.dash_cuda_architectures
    except AttributeError:
        return None
    fn.restype = ctypes.c_char_p
    return arch_names(fn().decode())


def arch_names(cmake_list: str) -> tuple[str, ...]:
    """CMake's CUDA_ARCHITECTURES (``"80-real,89-real,90"``; ``-virtual``: PTX only; a bare
    number: both) as torch's names (``sm_80``: machine code, ``compute_90``: PTX)."""
    out: list[str] = []
    for item in filter(None, (x.strip() for x in cmake_list.replace(";", ",").split(","))):
        num, _, kind = item.partition("-")
        if not num.removesuffix("a").isdigit():
            out.append(item)  # "native", "all", "unknown": as built
            continue
        if kind in ("", "real"):
            out.append(f"sm_{num}")
        if kind in ("", "virtual"):
            out.append(f"compute_{num}")
    return tuple(out)


def runs_on(capability: tuple[int, int], archs: Sequence[str]) -> bool:
    """Whether code for ``archs`` runs on a GPU of compute ``capability``: machine code of the
    same major version and an equal or lower minor, or PTX of an equal or lower version; code
    for an architecture-specific target (``sm_90a``, ``compute_90a``) on that very GPU only."""
    major, minor = capability
    for a in archs:
        kind, _, num = a.partition("_")
        specific = num.endswith("a")
        num = num.removesuffix("a")
        if not num.isdigit():
            return True  # not a list we can judge ("native", "all")
        m, n = int(num[:-1]), int(num[-1])
        if specific:
            if (m, n) == (major, minor):
                return True
            continue
        if kind == "sm" and m == major and n <= minor:
            return True
        if kind == "compute" and (m, n) <= (major, minor):
            return True
    return False


def supported_head_dims() -> tuple[int, ...]:
    lib = _library()
    n = lib.dash_supported_head_dims(None, 0)
    arr = (ctypes.c_int32 * n)()
    lib.dash_supported_head_dims(arr, n)
    return tuple(arr)


def _check(lib, status: int, what: str) -> None:
    if status != _STATUS_OK:
        name = lib.dash_status_string(status).decode()
        raise DashKernelError(f"{what}: {name}: {lib.dash_last_error_message().decode()}")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@lru_cache(maxsize=256)
def _config_fields_cached(cfg, layer_idx: int) -> tuple:
    return tuple(_config_fields(cfg, layer_idx).items())


#: The DashParams fields this binding writes, by group (plugins/include/dash/params.def; checked
#: against the library's table when it is loaded).
_SIZE_FIELDS = (
    "num_tokens",
    "num_seqs",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "index_dim",
    "num_blocks",
    "block_size",
    "table_width",
    "max_new_tokens",
    "dtype",
)
_CONFIG_FIELDS = (
    "sparse_block_size",
    "sparse_local_block",
    "topk",
    "route_scale",
    "prior_floor",
    "sigma",
    "rope_page_pairs",
    "rope_tok_theta",
    "rope_page_theta",
    "main_truncate",
    "index_truncate",
    "rope_page_mod",
)
#: The DashParams pointers of the operator's token and batch inputs, in the operator's order.
_INPUT_FIELDS = (*TOKEN_FIELDS, *BATCH_FIELDS)


def _config_fields(cfg, layer_idx: int) -> dict:
    """The configuration fields of DashParams for one layer (its routing values resolved)."""
    r = cfg.routing(layer_idx)
    values = (
        cfg.sparse_block_size,
        cfg.sparse_local_block,
        r.topk,
        r.scale,
        r.floor,
        r.sigma,
        cfg.sparse_rope_page_pairs,
        float(cfg.sparse_rope_tok_theta),
        float(cfg.sparse_rope_page_theta),
        int(cfg.sparse_main_rope_tok_freq_mode == "truncate"),
        int(cfg.sparse_rope_tok_freq_mode == "truncate"),
        cfg.sparse_rope_page_mod,
    )
    return dict(zip(_CONFIG_FIELDS, values, strict=True))


def check_sizes(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    index_dim: int,
    num_blocks: int,
    block_size: int,
    table_width: int,
    sp: SpLike,
    dtype: torch.dtype,
    num_layers: int,
) -> None:
    """Ask the kernel library whether it runs these sizes for every layer (no device work):
    raises :class:`DashKernelError` with its message (e.g. a block table too wide for the
    routing stage) so a runtime fails when it is built, not at its first step."""
    cfg = as_config(sp)
    lib = _library()
    for layer in range(num_layers):
        p = _shape_params(
            (
                0,
                1,
                num_heads,
                num_kv_heads,
                head_dim,
                index_dim,
                num_blocks,
                block_size,
                table_width,
                0,
                _DTYPE_CODES[dtype],
            ),
            _config_fields_cached(cfg, layer),
            _DEFAULT_TUNING,
        )
        size = ctypes.c_size_t(0)
        _check(
            lib,
            lib.dash_workspace_size(ctypes.byref(p), ctypes.byref(size)),
            f"layer {layer}: {table_width} blocks of {block_size} tokens per sequence",
        )


def paged_dash_attention_cuda(
    *args,
    validate: bool = True,
    check_errors: bool | None = None,
    return_selected: bool = False,
    return_routing: bool = False,
    max_query_len: int | None = None,
    tuning: Tuning | None = None,
    **kwargs,
):
    """:func:`dash_trt.attention.dash.paged.paged_dash_attention` on the CUDA kernels: the same arguments
    (``q, k, v, iq, ik, coords, head_cls, cache, block_tables, seq_lens, query_start_loc,
    prompt_lens, sp, layer_idx``, bound by :meth:`~dash_trt.attention.dash.paged.OperatorCall.bind`; a
    :class:`~dash_trt.attention.dash.paged.DashBatch` may stand for the four batch tensors).

    ``validate=True`` checks the batch metadata on the host first (a device sync);
    ``check_errors`` (default: ``validate``) reads the kernels' data-error flag afterwards
    (another sync). Pass ``validate=False`` inside CUDA-graph capture: the kernels still
    never access memory out of bounds on bad metadata, they skip it and flag it.
    ``return_selected`` also returns the selected sparse blocks [T, kmax] (-1 padded);
    ``return_routing`` a :class:`~dash_trt.attention.dash.reference.Routing` of them and their logit bias
    [T, kmax] float32 (0 at the padding), what the attention stage added.
    ``max_query_len`` is the most new tokens any one sequence has in this call (vLLM's
    ``max_query_len``; ``None``: T). With 1, a decode-only step, the kernels fold the cache
    write and the block summary into the routing and attention launches (two launches fewer).
    A sequence with more new tokens is an error: a ``ValueError`` with ``validate``, else the
    kernels skip it and flag it. ``tuning`` overrides the kernels' knobs (:class:`Tuning`).

    Planning is separate from the launch (``dash_plan`` / ``dash_run_plan``): the plan of a
    shape (sizes, layer configuration, tuning) is made once and kept (a small LRU), so every
    layer of a step with the same shape only fills pointers and launches.
    """
    call = OperatorCall.bind(*args, **kwargs)
    q, k, v, iq, ik, coords, head_cls = call.token_tensors()
    cache, cfg, layer_idx = call.cache, call.cfg, call.layer_idx
    block_tables, seq_lens, query_start_loc, prompt_lens = call.batch.tensors()
    if cache.quantized:  # before anything else: the kernels would read fp8 bytes as q's dtype
        raise DashKernelError(FP8_UNSUPPORTED)
    lib = _library()
    if validate:
        call.check()
    else:
        check_shape("q", q, (None, None, None), FLOAT_DTYPES)
        check_shape("k", k, (q.shape[0], None, q.shape[2]), (q.dtype,))
        check_heads(cfg, q, k, iq)
    if not q.is_cuda:
        raise ValueError(f"paged_dash_attention_cuda needs CUDA tensors, got q on {q.device}")
    if max_query_len is not None:
        if isinstance(max_query_len, bool) or not isinstance(max_query_len, int) or max_query_len < 1:
            raise ValueError(f"max_query_len must be a positive int or None, got {max_query_len!r}")
        if validate:
            most = (
                int(torch.diff(query_start_loc.detach().to("cpu", torch.int64)).max())
                if len(query_start_loc) > 1
                else 0
            )
            if most > max_query_len:
                raise ValueError(f"max_query_len={max_query_len}, but a sequence has {most} new tokens")
    device = q.device
    t, h, d = q.shape
    hkv, di = k.shape[1], iq.shape[1]
    nb, bsz = cache.key.shape[:2]
    i32 = lambda x: x.to(device=device, dtype=torch.int32).contiguous()  # noqa: E731
    coords32, tables32, lens32, qsl32, prompts32 = map(
        i32, (coords, block_tables, seq_lens, query_start_loc, prompt_lens)
    )
    q, k, v, iq, ik = (x.contiguous() for x in (q, k, v, iq, ik))
    head_cls = head_cls.to(device=device, dtype=q.dtype).contiguous()
    for name, tensor in cache.tensors().items():
        if not tensor.is_contiguous():
            raise ValueError(f"cache.{name} must be contiguous (it is written in place)")
    out = torch.empty_like(q)
    tune = tuning if tuning is not None else _DEFAULT_TUNING
    p, plan, size = _planned(
        lib,
        (
            t,
            tables32.shape[0],
            h,
            hkv,
            d,
            di,
            nb,
            bsz,
            tables32.shape[1],
            t if max_query_len is None else min(t, max_query_len),
            _DTYPE_CODES[q.dtype],
        ),
        cfg,
        layer_idx,
        tune,
        device,
    )
    inputs = (q, k, v, iq, ik, coords32, head_cls, tables32, lens32, qsl32, prompts32)
    for name, tensor in zip(_INPUT_FIELDS, inputs, strict=True):
        setattr(p, name, _ptr(tensor))
    for name, tensor in cache.tensors().items():
        setattr(p, f"{name}_cache", _ptr(tensor))
    p.out = _ptr(out)
    workspace = torch.empty(max(size, 1), dtype=torch.uint8, device=device)
    p.workspace, p.workspace_size = workspace.data_ptr(), size
    selected = bias = None
    if return_selected or return_routing:
        kmax = lib.dash_max_selected(ctypes.byref(p))
        selected = torch.empty(t, kmax, dtype=torch.int32, device=device)
        p.selected_out = selected.data_ptr()
    if return_routing:
        bias = torch.empty(t, kmax, dtype=torch.float32, device=device)
        p.bias_out = bias.data_ptr()
    stream = torch.cuda.current_stream(device).cuda_stream
    with torch.cuda.device(device):  # the library launches on the current device
        _check(lib, lib.dash_run_plan(ctypes.byref(p), ctypes.byref(plan), ctypes.c_void_p(stream)), "dash_run_plan")
        mask = ctypes.c_int32(0)
        if (validate if check_errors is None else check_errors) and t:
            _check(
                lib,
                lib.dash_read_data_errors(ctypes.byref(p), ctypes.c_void_p(stream), ctypes.byref(mask)),
                "dash_read_data_errors",
            )
        if mask.value:
            bad = [msg for bit, msg in DATA_ERRORS.items() if mask.value & bit]
            raise DashKernelError("kernels skipped bad metadata: " + "; ".join(bad))
    if return_routing:
        return out, Routing(selected.long(), bias)
    if return_selected:
        return out, selected.long()
    return out


_DEFAULT_TUNING = Tuning()
_PLANS: OrderedDict = OrderedDict()
_PLAN_CACHE_SIZE = 256


def _shape_params(sizes: tuple, config: tuple, tune: Tuning) -> ctypes.Structure:
    """DashParams with every size, configuration (:func:`_config_fields_cached`) and tuning
    field set, no pointers."""
    return _mirror()(**dict(zip(_SIZE_FIELDS, sizes, strict=True)), **dict(config), **tune.params())


def _planned(lib, sizes: tuple, cfg, layer_idx: int, tune: Tuning, device: torch.device):
    """(params with every size, configuration and tuning field set, their plan, workspace
    bytes) for this shape on this GPU: planned on first use, then a copy of the kept params.
    A plan depends on the GPU (its SM count, shared memory and architecture), so the cache is
    keyed by the device too."""
    config = _config_fields_cached(cfg, layer_idx)
    key = (device.index, sizes, config, tune)
    hit = _PLANS.get(key)
    if hit is None:
        template = _shape_params(sizes, config, tune)
        plan = DashPlan()
        with torch.cuda.device(device):  # dash_plan reads the current device's properties
            _check(lib, lib.dash_plan(ctypes.byref(template), ctypes.byref(plan)), "dash_plan")
        hit = (template, plan, int(lib.dash_plan_workspace_size(ctypes.byref(plan))))
        _PLANS[key] = hit
        if len(_PLANS) > _PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    template, plan, size = hit
    return _mirror().from_buffer_copy(template), plan, size


_warned_fallback = False


def _warn_fallback(exc: Exception) -> None:
    global _warned_fallback
    if not _warned_fallback:
        import warnings

        warnings.warn(f"DASH CUDA kernels: {exc}; running the PyTorch paged operator instead", stacklevel=3)
        _warned_fallback = True


def supports(
    head_dim: int,
    index_dim: int,
    kv_block_size: int,
    sparse_block_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
) -> str | None:
    """None if the kernels run these sizes (so the in-place op never falls back to the PyTorch
    operator, and a step can be captured in a CUDA graph), else the reason. ``kv_cache_dtype``:
    the cache's storage (``DashKVCache.kv_cache_dtype``); the kernels read only ``"auto"``."""
    if kv_cache_dtype != "auto":
        return FP8_UNSUPPORTED
    if not available():
        return "the kernel library or a CUDA device is not available"
    if head_dim not in supported_head_dims():
        return f"unsupported head dim: {head_dim} (supported: {', '.join(map(str, supported_head_dims()))})"
    if index_dim % 2 or index_dim > 512:
        return f"unsupported index dim: {index_dim} (even, at most 512)"
    if kv_block_size % sparse_block_size:
        return f"KV block size {kv_block_size} is not a whole multiple of the sparse block size {sparse_block_size}"
    if dtype not in _DTYPE_CODES:
        return f"unsupported dtype {dtype}"
    return None


def _kernels_or_fallback(call: OperatorCall, **options) -> torch.Tensor:
    """``call`` on the kernels; where they do not run it (``DASH_ERR_UNSUPPORTED``: sizes they
    do not support, a routing rule other than the function's) the PyTorch paged operator, with a
    warning the first time. Either way the cache is written in place."""
    try:
        return paged_dash_attention_cuda(*call.args(), **options)
    except DashKernelError as exc:
        if "DASH_ERR_UNSUPPORTED" not in str(exc):
            raise
        _warn_fallback(exc)
        return paged_dash_attention(*call.args())


def op_impl_inplace(call: OperatorCall, max_query_len: int) -> torch.Tensor:
    """The CUDA implementation of the in-place op ``dash_trt::paged_attention_`` (see
    :func:`dash_trt.attention.dash.ops.register_cuda_impl`): the kernels write the caches where they are,
    with no host validation and no sync (the runtime's metadata is built by its own pool),
    so the call can be captured in a CUDA graph."""
    return _kernels_or_fallback(call, validate=False, check_errors=False, max_query_len=int(max_query_len))


def op_impl(call: OperatorCall) -> tuple[torch.Tensor, ...]:
    """The CUDA implementation of the functional torch op ``dash_trt::paged_attention``
    (see :func:`dash_trt.attention.dash.ops.register_cuda_impl`): the kernels write into clones of the
    caches, which are returned."""
    cache = call.cache.clone()
    out = _kernels_or_fallback(dataclasses.replace(call, cache=cache))
    return (out, *cache.tensors().values())
