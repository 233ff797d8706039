"""The DashAttention TensorRT plugin, driven through its harness library without TensorRT.

``libdash_trt_plugin_harness.so`` (built with ``-DDASH_BUILD_TRT_PLUGIN=ON -DDASH_BUILD_TESTS=ON``,
see plugins/trt/README.md) creates the plugin through the creator that
``libdash_trt_plugin.so`` exports, from the same fields an ONNX node gives, and calls the
build and runtime methods the way TensorRT would. Found at ``$DASH_TRT_HARNESS`` or in a
``build*/`` folder of this checkout; every test here skips cleanly without it.

CPU tests (no GPU): the creator's field list against :class:`DashConfig`, attribute parsing and
validation messages, output types and shapes, aliasing, format support, configure and workspace
sizing, serialization round trips. GPU tests (``gpu``): ragged prefill/decode batches through
``enqueue`` on torch CUDA tensors, outputs and caches compared with
:func:`dash_trt.attention.dash.paged.paged_dash_attention` (the comparison rule of docs/spec.md),
caches written in place or into separate output buffers, int32 and int64 indices.
"""

from __future__ import annotations

import ctypes
import dataclasses
import glob
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dash_trt.attention.dash import ops
from dash_trt.attention.dash import paged as P
from dash_trt.attention.dash.attributes import PLUGIN_VERSION
from dash_trt.attention.dash.config import DashConfig
from dash_trt.serving.block_pool import KVBlockPool
from dash_trt.testing import (
    CONFIG_VARIANTS,
    assert_caches_match,
    compare_outputs,
    fill_garbage,
    prefill_then_decode,
    random_sequences,
)

HARNESS_NAME = "libdash_trt_plugin_harness.so"
MAX_DIMS = 8
DEVICE = "cuda"  # of the GPU tests


def harness_path() -> Path | None:
    env = os.environ.get("DASH_TRT_HARNESS")
    if env:
        return Path(env) if Path(env).is_file() else None
    root = Path(__file__).resolve().parents[1]
    found = [Path(p) for p in glob.glob(str(root / "build*" / "**" / HARNESS_NAME), recursive=True)]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


if harness_path() is None and os.environ.get("DASH_REQUIRE_HARNESS") == "1":
    raise RuntimeError(
        "DASH_REQUIRE_HARNESS=1 (set by .ci/run after building it) but libdash_trt_plugin_harness.so "
        "is not found: set DASH_TRT_HARNESS or build with -DDASH_BUILD_TRT_PLUGIN=ON -DDASH_BUILD_TESTS=ON"
    )

pytestmark = pytest.mark.skipif(
    harness_path() is None,
    reason=f"{HARNESS_NAME} not built (cmake -DDASH_BUILD_TRT_PLUGIN=ON -DDASH_BUILD_TESTS=ON; or DASH_TRT_HARNESS)",
)

# ------------------------------------------------------------------- the TensorRT major check
FAKE_NVINFER = "int getInferLibMajorVersion(void) { return %d; }\n"


def _fake_nvinfer(tmp_path: Path, soname: str, says: int) -> Path:
    """A stand-in TensorRT runtime: a library named ``soname`` whose getInferLibMajorVersion
    returns ``says`` (what the plugin reads of a loaded libnvinfer)."""
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to make a stand-in libnvinfer")
    src = tmp_path / f"{soname}.c"
    src.write_text(FAKE_NVINFER % says)
    out = tmp_path / soname
    subprocess.run([cc, "-shared", "-fPIC", f"-Wl,-soname,{soname}", "-o", str(out), str(src)], check=True)
    return out


def _plugin_in_process(tmp_path: Path, soname: str, says: int, library: str) -> subprocess.CompletedProcess:
    """In a fresh process: the stand-in runtime loaded first (as TensorRT would be), then the
    plugin ``library``; prints the creators getCreators hands out (the dynamic library)."""
    fake = _fake_nvinfer(tmp_path, soname, says)
    plugin = harness_path().with_name(library)
    code = (
        "import ctypes, sys\n"
        "ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)\n"
        "lib = ctypes.CDLL(sys.argv[2])\n"
        "if sys.argv[2].endswith('libdash_trt_plugin.so'):\n"
        "    n = ctypes.c_int32(-1)\n"
        "    lib.getCreators.restype = ctypes.c_void_p\n"
        "    lib.getCreators.argtypes = [ctypes.POINTER(ctypes.c_int32)]\n"
        "    lib.getCreators(ctypes.byref(n))\n"
        "    print('creators', n.value)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(fake), str(plugin)], capture_output=True, text=True, timeout=60
    )


def test_the_plugin_knows_the_tensorrt_it_was_built_for():
    from dash_trt.libraries import plugin_tensorrt_version

    header = harness_path().parents[2] / "CMakeCache.txt"
    version = plugin_tensorrt_version(harness_path().with_name("libdash_trt_plugin.so"))
    assert version is not None and version >= (10, 8), version
    assert plugin_tensorrt_version(harness_path().with_name("no_such_library.so")) is None
    if header.is_file():  # the build's own TensorRT headers
        roots = [line.split("=", 1)[1] for line in header.read_text().splitlines() if line.startswith("TensorRT_ROOT")]
        assert not roots or f"{version[0]}." in roots[0] or f"v{version[0]}" in roots[0], (roots, version)


@pytest.mark.parametrize("library", ["libdash_trt_plugin.so", "libdash_trt_plugin_static.so"])
def test_a_tensorrt_of_another_major_gets_nothing_registered(tmp_path, library):
    """A TensorRT runtime of another major than the plugin's headers is loaded: the plugin hands
    out no creator (the dynamic library) or registers none (the static one) and says which
    TensorRT it needs, instead of calling the runtime through vtables of another layout."""
    from dash_trt.libraries import plugin_tensorrt_version

    major = plugin_tensorrt_version(harness_path().with_name("libdash_trt_plugin.so"))[0]
    other = 11 if major == 10 else 10
    r = _plugin_in_process(tmp_path, f"libnvinfer.so.{other}", other, library)
    assert r.returncode == 0, r.stderr
    assert f"was built for TensorRT {major}" in r.stderr and f"this process runs TensorRT {other}" in r.stderr
    assert "nothing registered" in r.stderr
    if library == "libdash_trt_plugin.so":
        assert "creators 0" in r.stdout
        # the runtime of the plugin's own major (or one whose file name is another's but which
        # says it is ours): the creator is handed out, nothing printed
        for soname, says in ((f"libnvinfer.so.{major}", major), (f"libnvinfer_lean.so.{other}", major)):
            ok = _plugin_in_process(tmp_path, soname, says, library)
            assert ok.returncode == 0 and "creators 2" in ok.stdout and "built for" not in ok.stderr, ok.stderr


# ------------------------------------------------------------------------------ the I/O table
# The plugin's inputs in the ONNX node's order, with the symbols of their dims (plugins/trt).
INPUTS = [
    ("q", ("T", "H", "D")),
    ("k", ("T", "Hkv", "D")),
    ("v", ("T", "Hkv", "D")),
    ("iq", ("T", "Di")),
    ("ik", ("T", "Di")),
    ("coords", ("T", 4)),
    ("head_cls", ("Di",)),
    ("key_cache", ("NB", "BSZ", "Hkv", "D")),
    ("value_cache", ("NB", "BSZ", "Hkv", "D")),
    ("index_key_cache", ("NB", "BSZ", "Di")),
    ("image_page_cache", ("NB", "BSZ")),
    ("summary_cache", ("NB", "PER", "Di")),
    ("summary_pages_cache", ("NB", "PER", 3)),
    ("block_tables", ("B", "W")),
    ("seq_lens", ("B",)),
    ("query_start_loc", ("B+1",)),
    ("prompt_lens", ("B",)),
]
NAMES = [n for n, _ in INPUTS]
assert NAMES == list(ops.TENSOR_INPUTS), "the plugin's inputs are the op's (one name per tensor)"
NB_IN, NB_OUT = 17, 7

CACHE_FIELDS = ("key", "value", "index_key", "image_page", "summary", "summary_pages")  # DashKVCache order
INDEX_INPUTS = ("coords", "block_tables", "seq_lens", "query_start_loc", "prompt_lens")
OUTPUT_OF = [0] + [NAMES.index(f"{f}_cache") for f in CACHE_FIELDS]


def dims_for(sizes: dict, index_types=None, dtype="float16") -> list[tuple[tuple[int, ...], str]]:
    """(dims, type name) of the 17 inputs for symbol values ``sizes`` (T, H, D, ...)."""
    sizes = dict(sizes)
    sizes.setdefault("PER", -(-sizes["BSZ"] // sizes.get("sbs", sizes["BSZ"])))
    sizes["B+1"] = sizes["B"] + 1 if sizes["B"] >= 0 else -1
    kinds = {
        "coords": "index",
        "block_tables": "index",
        "seq_lens": "index",
        "query_start_loc": "index",
        "prompt_lens": "index",
        "image_page_cache": "int32",
        "summary_pages_cache": "int32",
        "summary_cache": "float32",
    }
    out = []
    for name, syms in INPUTS:
        dims = tuple(s if isinstance(s, int) else sizes[s] for s in syms)
        kind = kinds.get(name, "data")
        t = dtype if kind == "data" else ("int32" if kind == "index" else kind)
        if kind == "index" and index_types:
            t = index_types.get(name, index_types.get("*", "int32"))
        out.append((dims, t))
    return out


BASE_SIZES = dict(T=5, H=8, D=64, Hkv=2, Di=32, NB=16, BSZ=32, sbs=16, B=2, W=4)


# ---------------------------------------------------------------------------------- binding
class Tensor(ctypes.Structure):
    _fields_ = [
        ("rank", ctypes.c_int32),
        ("type", ctypes.c_int32),
        ("format", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("dims", ctypes.c_int64 * MAX_DIMS),
        ("min", ctypes.c_int64 * MAX_DIMS),
        ("opt", ctypes.c_int64 * MAX_DIMS),
        ("max", ctypes.c_int64 * MAX_DIMS),
    ]


class Harness:
    """ctypes view of plugins/tests/trt_harness.cpp."""

    def __init__(self, path: Path):
        lib = self.lib = ctypes.CDLL(str(path))
        c = ctypes
        T = c.POINTER(Tensor)
        sig = {
            "dash_harness_abi": (c.c_int32, []),
            "dash_harness_select_creator": (c.c_int32, [c.c_char_p]),
            "dash_harness_messages": (c.c_char_p, []),
            "dash_harness_clear_messages": (None, []),
            "dash_harness_type_code": (c.c_int32, [c.c_char_p]),
            "dash_harness_field_type_code": (c.c_int32, [c.c_char_p]),
            "dash_harness_format_code": (c.c_int32, [c.c_char_p]),
            "dash_harness_creator_info": (c.c_int32, [c.c_char_p, c.c_int32]),
            "dash_harness_create": (
                c.c_void_p,
                [
                    c.POINTER(c.c_char_p),
                    c.POINTER(c.c_int32),
                    c.POINTER(c.c_void_p),
                    c.POINTER(c.c_int32),
                    c.c_int32,
                    c.c_int32,
                ],
            ),
            "dash_harness_destroy": (None, [c.c_void_p]),
            "dash_harness_clone": (c.c_void_p, [c.c_void_p, c.c_int32]),
            "dash_harness_plugin_info": (c.c_int32, [c.c_void_p, c.c_char_p, c.c_int32]),
            "dash_harness_output_types": (
                c.c_int32,
                [c.c_void_p, c.POINTER(c.c_int32), c.c_int32, c.POINTER(c.c_int32), c.c_int32],
            ),
            "dash_harness_output_shapes": (c.c_int32, [c.c_void_p, T, c.c_int32, T, c.c_int32]),
            "dash_harness_aliased_input": (c.c_int32, [c.c_void_p, c.c_int32]),
            "dash_harness_supports": (c.c_int32, [c.c_void_p, c.c_int32, T, c.c_int32, c.c_int32]),
            "dash_harness_configure": (c.c_int32, [c.c_void_p, T, c.c_int32, c.c_int32]),
            "dash_harness_workspace_size": (c.c_int64, [c.c_void_p, T, c.c_int32, c.c_int32]),
            "dash_harness_on_shape_change": (c.c_int32, [c.c_void_p, T, c.c_int32, c.c_int32]),
            "dash_harness_enqueue": (
                c.c_int32,
                [
                    c.c_void_p,
                    T,
                    c.c_int32,
                    c.c_int32,
                    c.POINTER(c.c_void_p),
                    c.POINTER(c.c_void_p),
                    c.c_void_p,
                    c.c_void_p,
                ],
            ),
        }
        for name, (res, args) in sig.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        assert lib.dash_harness_abi() == 2
        self.types = {
            n: lib.dash_harness_type_code(n.encode())
            for n in ("float32", "float16", "bfloat16", "int32", "int64", "int8", "uint8", "bool")
        }
        self.field_types = {
            n: lib.dash_harness_field_type_code(n.encode())
            for n in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "char", "bf16")
        }
        self.formats = {n: lib.dash_harness_format_code(n.encode()) for n in ("linear", "chw32", "hwc8")}

    # -- messages
    def messages(self) -> str:
        return self.lib.dash_harness_messages().decode()

    def clear(self) -> None:
        self.lib.dash_harness_clear_messages()

    @staticmethod
    def _text(fn, *args) -> str:
        buf = ctypes.create_string_buffer(1 << 16)
        n = fn(*args, buf, len(buf))
        assert 0 <= n < len(buf)
        return buf.value.decode()

    @staticmethod
    def _lines(text: str) -> list[tuple[str, str]]:
        return [tuple(line.split("=", 1)) for line in text.splitlines() if "=" in line]

    def creator_info(self) -> list[tuple[str, str]]:
        return self._lines(self._text(self.lib.dash_harness_creator_info))

    def select(self, name: str) -> bool:
        """Make the creator of plugin ``name`` the one the other calls use."""
        return self.lib.dash_harness_select_creator(name.encode()) == 0

    # -- plugins
    def create(self, fields, phase: int = 0):
        """``fields``: [(name, field type name, values)]; values a list, or a str for "char"
        (encoded with a terminating NUL, as the ONNX parser does) or bytes (as given)."""
        keep, n = [], len(fields)
        names = (ctypes.c_char_p * n)()
        types = (ctypes.c_int32 * n)()
        data = (ctypes.c_void_p * n)()
        lengths = (ctypes.c_int32 * n)()
        ctype = {
            "int8": ctypes.c_int8,
            "int16": ctypes.c_int16,
            "int32": ctypes.c_int32,
            "int64": ctypes.c_int64,
            "float32": ctypes.c_float,
            "float64": ctypes.c_double,
        }
        for i, (name, ftype, values) in enumerate(fields):
            names[i] = name.encode()
            types[i] = self.field_types[ftype]
            if ftype == "char":
                raw = values.encode() + b"\0" if isinstance(values, str) else bytes(values)
                buf = ctypes.create_string_buffer(raw, len(raw))
                lengths[i] = len(raw)
            else:
                buf = (ctype[ftype] * max(len(values), 1))(*values)
                lengths[i] = len(values)
            keep.append(buf)
            data[i] = ctypes.cast(buf, ctypes.c_void_p)
        handle = self.lib.dash_harness_create(names, types, data, lengths, n, phase)
        return Plugin(self, handle) if handle else None

    def tensors(self, descs) -> ctypes.Array:
        """descs: [(dims, type name[, format name[, min dims, max dims]])] -> Tensor array."""
        arr = (Tensor * len(descs))()
        for t, d in zip(arr, descs):
            dims, tname = d[0], d[1]
            fmt = d[2] if len(d) > 2 and d[2] else "linear"
            lo = d[3] if len(d) > 3 else dims
            hi = d[4] if len(d) > 4 else dims
            t.rank, t.type, t.format = len(dims), self.types[tname], self.formats[fmt]
            for a, x in enumerate(dims):
                t.dims[a], t.opt[a], t.min[a], t.max[a] = x, max(x, 0), lo[a], hi[a]
        return arr


class Plugin:
    def __init__(self, harness: Harness, handle: int):
        self.h, self.handle = harness, handle

    def __del__(self):
        if self.handle:
            self.h.lib.dash_harness_destroy(self.handle)
            self.handle = None

    def info(self) -> dict[str, str]:
        lines = self.h._lines(self.h._text(self.h.lib.dash_harness_plugin_info, self.handle))
        out = {k: v for k, v in lines if k != "serialized"}
        out["serialized"] = [v for k, v in lines if k == "serialized"]
        return out

    def clone(self, mode: int) -> Plugin | None:
        handle = self.h.lib.dash_harness_clone(self.handle, mode)
        return Plugin(self.h, handle) if handle else None

    def output_types(self, type_names: list[str]) -> tuple[int, list[int]]:
        n = len(type_names)
        ins = (ctypes.c_int32 * n)(*[self.h.types[t] for t in type_names])
        outs = (ctypes.c_int32 * NB_OUT)()
        status = self.h.lib.dash_harness_output_types(self.handle, ins, n, outs, NB_OUT)
        return status, list(outs)

    def output_shapes(self, descs, nb_out: int = NB_OUT):
        ins = self.h.tensors(descs)
        outs = (Tensor * nb_out)()
        status = self.h.lib.dash_harness_output_shapes(self.handle, ins, len(descs), outs, nb_out)
        return status, [tuple(t.dims[a] for a in range(t.rank)) for t in outs]

    def aliased_input(self, o: int) -> int:
        return self.h.lib.dash_harness_aliased_input(self.handle, o)

    def supports(self, pos: int, descs, nb_in: int = NB_IN) -> bool:
        arr = self.h.tensors(descs)
        r = self.h.lib.dash_harness_supports(self.handle, pos, arr, nb_in, len(descs) - nb_in)
        assert r in (0, 1)
        return r == 1

    def configure(self, descs) -> int:
        return self.h.lib.dash_harness_configure(self.handle, self.h.tensors(descs), NB_IN, len(descs) - NB_IN)

    def workspace_size(self, descs) -> int:
        return self.h.lib.dash_harness_workspace_size(self.handle, self.h.tensors(descs), NB_IN, len(descs) - NB_IN)

    def on_shape_change(self, descs) -> int:
        return self.h.lib.dash_harness_on_shape_change(self.handle, self.h.tensors(descs), NB_IN, len(descs) - NB_IN)

    def enqueue(self, descs, inputs: list[int], outputs: list[int], workspace: int, stream: int) -> int:
        ins = (ctypes.c_void_p * len(inputs))(*inputs)
        outs = (ctypes.c_void_p * len(outputs))(*outputs)
        return self.h.lib.dash_harness_enqueue(
            self.handle,
            self.h.tensors(descs),
            NB_IN,
            len(descs) - NB_IN,
            ins,
            outs,
            ctypes.c_void_p(workspace),
            ctypes.c_void_p(stream),
        )


@pytest.fixture(scope="module")
def harness() -> Harness:
    return Harness(harness_path())


# ---------------------------------------------------------------------- ONNX-style attributes
def node_fields(
    cfg: DashConfig, layer_idx: int, *, ints: str = "int32", reals: str = "float32", version: str = PLUGIN_VERSION
):
    """The fields the ONNX parser builds from a dash_trt.DashAttention node's attributes
    (INT -> INT32, FLOAT -> FLOAT32, STRING -> CHAR with a NUL): the layer's attributes as the
    exporter writes them (dash_trt.attention.dash.attributes.encode: routing values resolved for the layer),
    then plugin_version and plugin_namespace."""
    from dash_trt.attention.dash import attributes as A

    kind = {"INT": ints, "FLOAT": reals, "STRING": "char"}
    out = []
    for a in A.OP_ATTRIBUTES:
        v = A.encode(cfg, layer_idx)[a.name]
        out.append((a.name, kind[a.onnx_type], v if a.onnx_type == "STRING" else [v]))
    out.append(("plugin_version", "char", version))
    out.append(("plugin_namespace", "char", ""))
    return out


def make_config(sbs=16, **kw) -> DashConfig:
    sp = {
        "sparse_block_size": sbs,
        "sparse_local_block": 1,
        "sparse_index_dim": 32,
        "dash_topk_blocks": 3,
        "dash_sigma": 0.75,
        "sparse_rope_page_pairs": 2,
    }
    sp.update(kw)
    return DashConfig.from_dict(sp)


def replace(fields, name, ftype=None, values=None, drop=False):
    out = [f for f in fields if f[0] != name]
    if not drop:
        old = next((f for f in fields if f[0] == name), (name, "int32", [0]))
        out.append((name, ftype or old[1], old[2] if values is None else values))
    return out


def plugin_for(harness, cfg=None, layer=0, **kw) -> Plugin:
    p = harness.create(node_fields(cfg or make_config(), layer, **kw))
    assert p is not None, harness.messages()
    return p


def io_descs(sizes=None, index_types=None, dtype="float16", outputs=True, bounds=None):
    """Descriptors of the 17 inputs (and the 7 outputs), optionally with profile bounds
    ``bounds`` = {symbol: (min, max)}."""
    sizes = dict(BASE_SIZES if sizes is None else sizes)
    ins = dims_for(sizes, index_types, dtype)
    descs = []
    for (_, syms), (dims, t) in zip(INPUTS, ins):
        lo, hi = list(dims), list(dims)
        for a, s in enumerate(syms):
            key = "B" if s == "B+1" else s
            if bounds and key in bounds:
                lo[a], hi[a] = bounds[key][0] + (s == "B+1"), bounds[key][1] + (s == "B+1")
        descs.append((dims, t, "linear", tuple(lo), tuple(hi)))
    if outputs:
        descs += [descs[i] for i in OUTPUT_OF]
    return descs


# ============================================================================== CPU tests
def test_creator_fields_are_the_config_keys(harness):
    info = harness.creator_info()
    meta = dict(info)
    assert meta["interface"] == "PLUGIN CREATOR_V3ONE 1.0"
    assert (meta["name"], meta["version"], meta["namespace"]) == ("DashAttention", PLUGIN_VERSION, "")
    fields = {}
    for k, v in info:
        if k == "field":
            name, ftype, length = v.split(":")
            fields[name] = (int(ftype), int(length))
    carried = {f.name for f in dataclasses.fields(DashConfig) if f.metadata["attribute"]}
    expected = carried | {"layer_idx", "plugin_version", "plugin_namespace"}
    assert set(fields) == expected
    assert "dash_topk_blocks" in fields and "sparse_index_dim" in fields and "sparse_topk_blocks" not in fields
    kinds = {f.name: f.metadata["kind"] for f in dataclasses.fields(DashConfig)}
    ft = harness.field_types
    for name, (ftype, length) in fields.items():
        kind = kinds.get(name, "int" if name == "layer_idx" else "mode")
        want = ft["float32"] if kind in ("float", "pos_float") else (ft["char"] if kind == "mode" else ft["int32"])
        assert ftype == want and length == 1, name


def test_node_attribute_table_matches_when_available(harness):
    """At merge time: the exporter's attribute table and the plugin's field list agree."""
    from dash_trt.attention.dash import attributes

    fields = {v.split(":")[0] for k, v in harness.creator_info() if k == "field"}
    assert {a.name for a in attributes.NODE_ATTRIBUTES} == fields
    assert attributes.PLUGIN_VERSION == dict(harness.creator_info())["version"]


def test_dual_chunk_attention_is_declared_and_refused_with_a_message(harness):
    """The plugin declares the dash_trt.DualChunkAttention creator (TensorRT's ONNX parser finds it
    by the node's op type and version 1) with the node's attribute table, dash_trt.attention.dca.ops's; it
    has no kernels yet, so createPlugin refuses, naming a bad attribute first if there is one."""
    from dash_trt.attention.dca.ops import ATTRIBUTES

    assert harness.select("DualChunkAttention")
    try:
        info = harness.creator_info()
        meta = dict(info)
        assert (meta["name"], meta["version"], meta["namespace"]) == ("DualChunkAttention", "1", "")
        ft = harness.field_types
        fields = [tuple(v.split(":")) for k, v in info if k == "field"]
        want = [(name, str(ft["int32"] if onnx == "INT" else ft["float32"]), "1") for name, _, onnx, _ in ATTRIBUTES]
        assert fields == want
        good = [(name, "int32" if onnx == "INT" else "float32", [1]) for name, _, onnx, _ in ATTRIBUTES]
        for fields_, said in (
            (good, "no Dual Chunk Attention kernels yet"),
            (good[1:], "attribute 'chunk_size' is missing"),
            (good + [("window", "int32", [4])], "unknown attribute 'window'"),
            ([("chunk_size", "float32", [1.0])] + good[1:], "attribute 'chunk_size' must be one INT"),
        ):
            harness.clear()
            assert harness.create(fields_) is None
            assert said in harness.messages() and "DualChunkAttention" in harness.messages(), harness.messages()
    finally:
        assert harness.select("DashAttention")
    assert not harness.select("NoSuchPlugin") and dict(harness.creator_info())["name"] == "DashAttention"


@pytest.mark.parametrize("variant", ["ints", "int64", "float64", "per_layer"])
def test_plugin_from_node_fields(harness, variant):
    harness.clear()
    cfg = make_config(
        32,
        dash_topk_blocks=7,
        sparse_rope_tok_theta=500.0,
        sparse_main_rope_tok_freq_mode="truncate",
        sparse_rope_page_mod=3,
    )
    kw = {"int64": {"ints": "int64"}, "float64": {"reals": "float64"}}.get(variant, {})
    if variant == "per_layer":
        cfg = make_config(
            32, sparse_attention_freq=[1, 0, 1], dash_scale_per_layer=[4.0, 40.0], dash_floor_per_layer=[0.5, 0.25]
        )
    p = plugin_for(harness, cfg, 2 if variant == "per_layer" else 1, **kw)
    info = p.info()
    assert (info["name"], info["version"], info["namespace"], info["outputs"]) == (
        "DashAttention",
        PLUGIN_VERSION,
        "",
        "7",
    )
    assert info["build_interface"] == "PLUGIN_V3ONE_BUILD 2.0"  # V2: aliasing
    meta = info["metadata"]
    assert "sparse_block_size=32" in meta and "sparse_index_dim=32" in meta
    if variant == "per_layer":  # the node carries layer 2's (slot 1's) values
        assert "layer_idx=2" in meta and "dash_scaling_factor=40 " in meta and "dash_prior_floor=0.25 " in meta
    else:
        assert "layer_idx=1" in meta and "dash_topk_blocks=7" in meta and "dash_sigma=0.75" in meta
        assert 'sparse_main_rope_tok_freq_mode="truncate"' in meta and "sparse_rope_tok_theta=500" in meta
    assert info["timing_cache_id"] == meta
    # Clone, attach to a context, and a serialize -> createPlugin(kRUNTIME) round trip keep the state.
    for mode in (0, 1, 2):
        q = p.clone(mode)
        assert q is not None, harness.messages()
        assert q.info()["metadata"] == meta and q.info()["serialized"] == info["serialized"]
    assert "[E]" not in harness.messages()


def test_defaults_and_the_onnx_string_encoding(harness):
    """Only the required attributes: everything else takes the DashConfig defaults; strings with
    or without a terminating NUL."""
    fields = [
        ("sparse_block_size", "int32", [16]),
        ("sparse_local_block", "int32", [2]),
        ("sparse_index_dim", "int32", [32]),
        ("layer_idx", "int32", [0]),
        ("sparse_rope_tok_freq_mode", "char", b"truncate"),
    ]
    p = harness.create(fields)
    assert p is not None, harness.messages()
    meta = p.info()["metadata"]
    d = DashConfig.from_dict({"sparse_block_size": 16, "sparse_local_block": 2, "sparse_index_dim": 32})
    for expect in (
        f"dash_topk_blocks={d.dash_topk_blocks}",
        f"dash_scaling_factor={d.dash_scaling_factor:g}",
        f"dash_prior_floor={d.dash_prior_floor:g}",
        f"dash_sigma={d.dash_sigma:g}",
        f"sparse_rope_page_theta={d.sparse_rope_page_theta:g}",
        'sparse_rope_tok_freq_mode="truncate"',
        'sparse_main_rope_tok_freq_mode=""',
        f'plugin_version="{PLUGIN_VERSION}"',
        "dash_query_chunk=2048",
        "image_token_id=-1",
    ):
        assert expect in meta, meta


BAD_FIELDS = [
    (lambda f: replace(f, "sparse_block_size", drop=True), "'sparse_block_size' is required"),
    (lambda f: replace(f, "layer_idx", drop=True), "'layer_idx' is required"),
    (lambda f: f + [("sparse_blok_size", "int32", [4])], "unknown attribute 'sparse_blok_size'"),
    (lambda f: f + [("layer_idx", "int32", [0])], "'layer_idx' is given twice"),
    (lambda f: replace(f, "sparse_index_dim", drop=True), "'sparse_index_dim' is required"),
    (lambda f: replace(f, "sparse_rope_tok_theta", values=[0.0]), "'sparse_rope_tok_theta' must be > 0"),
    (lambda f: replace(f, "dash_scaling_factor", values=[math.nan]), "'dash_scaling_factor' must be finite"),
    (lambda f: replace(f, "dash_scaling_factor", values=[math.inf]), "'dash_scaling_factor' must be finite"),
    (lambda f: replace(f, "dash_sigma", values=[0.0]), "'dash_sigma' must be > 0"),
    (lambda f: replace(f, "dash_prior_floor", values=[-1e-4]), "'dash_prior_floor' must be > 0"),
    (lambda f: replace(f, "sparse_rope_tok_freq_mode", values="truncated"), 'must be "", "default" or "truncate"'),
    (lambda f: replace(f, "dash_topk_blocks", values=[3, 4]), "'dash_topk_blocks' must be one integer"),
    (lambda f: replace(f, "dash_topk_blocks", values=[0]), "'dash_topk_blocks' must be >= 1"),
    (lambda f: f + [("sparse_topk_blocks", "int32", [16])], "unknown attribute 'sparse_topk_blocks'"),
    (lambda f: replace(f, "sparse_local_block", values=[0]), "'sparse_local_block' must be >= 1"),
    (lambda f: replace(f, "sparse_block_size", "int64", [2**31]), "'sparse_block_size' does not fit in int32"),
    (lambda f: replace(f, "sparse_block_size", "float32", [16.0]), "'sparse_block_size' must be integer"),
    (lambda f: replace(f, "sparse_block_size", values=[16, 32]), "'sparse_block_size' must be one integer"),
    (lambda f: replace(f, "dash_sigma", values=[1.0, 2.0]), "'dash_sigma' must be one number"),
    (lambda f: replace(f, "sparse_rope_page_mod", "char", "3"), "'sparse_rope_page_mod' must be integer"),
    (lambda f: replace(f, "image_token_id", values=[-2]), "'image_token_id' must be -1 (not set)"),
    (lambda f: replace(f, "plugin_version", values="1"), 'but this plugin implements version "2"'),
    (lambda f: replace(f, "plugin_namespace", values="acme"), "'plugin_namespace' is \"acme\""),
]


@pytest.mark.parametrize("edit, message", BAD_FIELDS)
def test_bad_attributes_are_refused_with_a_message(harness, edit, message):
    harness.clear()
    fields = edit(node_fields(make_config(), 5))
    assert harness.create(fields) is None
    assert message in harness.messages(), harness.messages()
    assert "[E] DashAttention: layer 'harness': createPlugin (build)" in harness.messages()


def test_output_types(harness):
    p = plugin_for(harness)
    for dtype in ("float32", "float16", "bfloat16"):
        types = [t for _, t in dims_for(BASE_SIZES, {"*": "int64"}, dtype)]
        status, out = p.output_types(types)
        assert status == 0
        assert out == [harness.types[types[i]] for i in OUTPUT_OF]
    harness.clear()
    assert p.output_types(types[:16])[0] != 0
    assert "expects 17 inputs and 7 outputs" in harness.messages()


def test_output_shapes(harness):
    p = plugin_for(harness)
    descs = io_descs(outputs=False)
    status, shapes = p.output_shapes(descs)
    assert status == 0
    assert shapes == [descs[i][0] for i in OUTPUT_OF]
    # Runtime (unknown) dims stay unknown; constant dims are still cross-checked.
    sym = dict(BASE_SIZES, T=-1, B=-1, W=-1, NB=-1)
    status, shapes = p.output_shapes([(d, t) for d, t in dims_for(sym)])
    assert status == 0 and shapes[0] == (-1, 8, 64) and shapes[1] == (-1, 32, 2, 64)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.__setitem__(1, ((5, 2, 32), d[1][1])), "k dim 2 is 32, but q dim 2 (D (head dim)) is 64"),
        (lambda d: d.__setitem__(5, ((5, 3), d[5][1])), "coords dim 1 is 3, but it must be 4"),
        (lambda d: d.__setitem__(15, ((2,), d[15][1])), "query_start_loc has 2 entries, but block_tables has 2 rows"),
        (
            lambda d: (d.__setitem__(11, ((16, 4, 32), d[11][1])), d.__setitem__(12, ((16, 4, 3), d[12][1]))),
            "summary_cache dim 1 is 4, but block_size 32 / sparse_block_size 16 needs 2",
        ),
        (lambda d: d.__setitem__(7, ((16, 32, 2), d[7][1])), "input 7 (key_cache) must have rank 4, got 3"),
        (lambda d: d.__setitem__(8, ((16, 16, 2, 64), d[8][1])), "value_cache dim 1 is 16, but key_cache dim 1"),
    ],
)
def test_bad_shapes_are_refused(harness, change, message):
    p = plugin_for(harness)
    descs = [(d, t) for d, t in dims_for(BASE_SIZES)]
    change(descs)
    harness.clear()
    status, _ = p.output_shapes(descs)
    assert status != 0
    assert message in harness.messages(), harness.messages()
    harness.clear()
    assert p.on_shape_change(descs + [descs[i] for i in OUTPUT_OF]) != 0
    assert message in harness.messages(), harness.messages()


def test_caches_are_aliased_in_place(harness):
    p = plugin_for(harness)
    assert [p.aliased_input(o) for o in range(-1, NB_OUT + 1)] == [-1, -1, 7, 8, 9, 10, 11, 12, -1]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("index", ["int32", "int64", "mixed"])
def test_supported_formats(harness, dtype, index):
    p = plugin_for(harness)
    types = {"*": index} if index != "mixed" else {"*": "int32", "coords": "int64", "seq_lens": "int64"}
    descs = io_descs(index_types=types, dtype=dtype)
    assert all(p.supports(pos, descs) for pos in range(NB_IN + NB_OUT))


@pytest.mark.parametrize(
    "pos, type_name, fmt",
    [
        (0, "int32", None),  # q must be float
        (0, "int8", None),
        (1, "float32", None),  # k must have q's type (q is float16 here)
        (7, "bfloat16", None),  # key cache must have q's type
        (6, "float32", None),  # head_cls too
        (5, "float16", None),  # coords are integers
        (13, "int8", None),  # block tables: int32 or int64
        (10, "int64", None),  # image pages: int32 only
        (11, "float16", None),  # summaries: float32 only
        (12, "int64", None),  # summary pages: int32 only
        (17, "float32", None),  # output: q's type
        (18, "bfloat16", None),  # cache output: its input's type
        (22, "float16", None),  # summary output: float32
        (0, "float16", "chw32"),  # linear format only
        (13, "int32", "hwc8"),
    ],
)
def test_unsupported_formats(harness, pos, type_name, fmt):
    p = plugin_for(harness)
    descs = io_descs(dtype="float16")
    dims, _, _, lo, hi = descs[pos]
    descs[pos] = (dims, type_name, fmt or "linear", lo, hi)
    assert not p.supports(pos, descs)


def test_format_query_with_wrong_counts_is_refused(harness):
    p = plugin_for(harness)
    descs = io_descs()
    assert not p.supports(0, descs[:-1], nb_in=NB_IN)
    assert not p.supports(0, descs[1:], nb_in=NB_IN - 1)


def test_configure_and_workspace_from_profile_bounds(harness):
    p = plugin_for(harness)
    bounds = {"T": (1, 96), "B": (1, 4), "W": (1, 6), "NB": (8, 64)}
    sizes = dict(BASE_SIZES, T=32, B=2, W=4, NB=16)
    descs = io_descs(sizes, bounds=bounds)
    harness.clear()
    assert p.configure(descs) == 0, harness.messages()
    assert "[E]" not in harness.messages(), harness.messages()
    ws = p.workspace_size(descs)
    assert ws > 0
    # Enough for every shape of the profile: the workspace is not monotone in T (split-K scratch
    # for small T), so compare with each single-shape size.
    for t in range(1, 97):
        for b, w in ((1, 1), (4, 6)):
            one = io_descs(dict(sizes, T=t, B=b, W=w))
            assert p.workspace_size(one) <= ws, (t, b, w)
    # int64 indices need room for their int32 copies.
    ws64 = p.workspace_size(io_descs(sizes, index_types={"*": "int64"}, bounds=bounds))
    assert ws64 > ws
    assert "[E]" not in harness.messages()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(D=96), "unsupported head dim: 96"),
        (dict(BSZ=24, PER=2), "KV block size 24 is not a whole multiple of the sparse block size 16"),
        (dict(H=6, Hkv=4), "must be a multiple of KV heads"),
        (dict(Di=7), "iq dim 1 (Di) is 7, but attribute sparse_index_dim is 32"),
        (dict(Di=514), "unsupported index dim: 514"),
    ],
)
def test_configure_refuses_what_the_kernels_cannot_run(harness, change, message):
    p = plugin_for(harness, make_config(sparse_index_dim=change.get("Di", 32)) if change.get("Di") == 514 else None)
    descs = io_descs(dict(BASE_SIZES, **change))
    harness.clear()
    assert p.configure(descs) != 0
    assert message in harness.messages(), harness.messages()
    assert "configurePlugin" in harness.messages()


def test_enqueue_validates_before_touching_memory(harness):
    """Needs no GPU: the shapes are refused before any CUDA call."""
    p = plugin_for(harness)
    descs = io_descs(dict(BASE_SIZES, D=96))
    fake = [4096 * (i + 1) for i in range(NB_IN)]
    outs = [1 << 20] + [fake[i] for i in OUTPUT_OF[1:]]  # caches "aliased": same pointers
    harness.clear()
    assert p.enqueue(descs, fake, outs, 1 << 21, 0) != 0
    assert "enqueue: DASH_ERR_UNSUPPORTED: unsupported head dim: 96" in harness.messages()
    # No new tokens and caches in place: nothing to do, nothing touched.
    assert p.enqueue(io_descs(dict(BASE_SIZES, T=0)), fake, outs, 0, 0) == 0


def test_workspace_size_depends_on_every_dim_of_the_profile(harness):
    """The KV block count sizes the block-major prefill's buffers: two profiles that differ only
    in it get different answers (the cached answer must not be reused)."""
    p = plugin_for(harness, make_config(64))  # the block-major path runs sparse blocks of 64
    sizes = dict(BASE_SIZES, T=2048, B=1, W=8, BSZ=64, sbs=64)
    small = p.workspace_size(io_descs(dict(sizes, NB=64)))
    large = p.workspace_size(io_descs(dict(sizes, NB=4096)))
    assert large > small > 0
    assert p.workspace_size(io_descs(dict(sizes, NB=64))) == small


def test_workspace_bound_covers_narrower_tables_than_the_widest(harness):
    """Past DASH_QUERY_MAJOR_MAX_BLOCKS (40,960) sparse blocks the query-major tiles are off, so a
    table of exactly that width needs more workspace than a wider one: the profile's bound is
    taken over both, and every width of the profile fits in it."""
    p = plugin_for(harness, make_config(64))
    sizes = dict(BASE_SIZES, T=2048, B=1, BSZ=64, sbs=64, NB=50000)
    at_limit = p.workspace_size(io_descs(dict(sizes, W=40960)))
    past = p.workspace_size(io_descs(dict(sizes, W=40961)))
    assert at_limit > past > 0  # what makes the bound non-monotone (query-major buffers)
    bounds = {"T": (1, 2048), "B": (1, 1), "W": (1, 50000), "NB": (50000, 50000)}
    bound = p.workspace_size(io_descs(dict(sizes, W=50000), bounds=bounds))
    assert bound >= at_limit, (bound, at_limit)


def test_enqueue_refuses_a_call_larger_than_its_workspace(harness):
    """Needs no GPU: the workspace TensorRT allocated is getWorkspaceSize's answer for the
    profile; a call that needs more is refused before any buffer is touched, also after the
    plugin went through serialization (the bound travels as a field)."""
    p = plugin_for(harness)
    bounds = {"T": (1, 8), "B": (1, 2), "W": (1, 4), "NB": (8, 16)}
    profile = io_descs(dict(BASE_SIZES, T=8, B=2, W=4, NB=16), bounds=bounds)
    assert p.configure(profile) == 0, harness.messages()
    ws = p.workspace_size(profile)
    big = io_descs(dict(BASE_SIZES, T=4000, B=2, W=4, NB=16))
    fake = [4096 * (i + 1) for i in range(NB_IN)]
    outs = [1 << 20] + [fake[i] for i in OUTPUT_OF[1:]]
    for plugin in (p, p.clone(0), p.clone(2)):
        assert plugin is not None, harness.messages()
        harness.clear()
        assert plugin.enqueue(big, fake, outs, 1 << 21, 0) != 0
        assert f"bytes of workspace, TensorRT allocated {ws}" in harness.messages(), harness.messages()
    serialized = p.clone(2).info()["serialized"]
    assert any(f.startswith("workspace_bytes:10:1:") for f in serialized), serialized  # INT64, one value


# ============================================================================== GPU tests
TORCH_TYPE = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int32: "int32",
    torch.int64: "int64",
}

GPU_DTYPES = [torch.float16, torch.bfloat16]
SHAPES = [  # heads, kv_heads, head_dim, index_dim, KV block = sbs * multiple
    (8, 2, 64, 32, 1),
    (4, 4, 128, 64, 2),
    (32, 8, 128, 64, 4),
]
INDEX_VARIANTS = ["int32", "int64", "mixed"]
CACHE_MODES = ["in_place", "separate_outputs"]


def _build_sequences(gen, n, **kw):
    return random_sequences(gen, n, device=DEVICE, **kw)


_plans = prefill_then_decode


def _index_type(variant: str, name: str) -> torch.dtype:
    if variant == "mixed":  # int64 coordinates and lengths, int32 tables and offsets
        return torch.int64 if name in ("coords", "seq_lens", "prompt_lens") else torch.int32
    return torch.int64 if variant == "int64" else torch.int32


def _kernel_binding():
    """dash_trt.attention.dash.cuda when its library is built (for the routing of each token and a bitwise
    cross-check: the plugin calls the same dash_run)."""
    try:
        from dash_trt.attention.dash import cuda
    except ImportError:  # pragma: no cover
        return None
    return cuda if cuda.available() else None


def _run_case(harness, *, dtype, shape, index_variant, cache_mode, cfg=None, layer=0, seed=0, prompts=None, response=8):
    heads, kv_heads, head_dim, index_dim, multiple = shape
    cfg = dataclasses.replace(cfg or make_config(16), sparse_index_dim=index_dim)  # the case's indexer width
    gen = torch.Generator().manual_seed(seed + heads + head_dim + multiple)
    seqs = _build_sequences(
        gen, 3, heads=heads, kv_heads=kv_heads, head_dim=head_dim, index_dim=index_dim, dtype=dtype, response=response
    )
    plans = _plans(gen, seqs, response)
    block_size = cfg.sparse_block_size * multiple
    num_blocks = sum(-(-x.length // block_size) for x, _ in seqs) + 3
    ref_cache = P.DashKVCache.allocate(
        num_blocks, block_size, kv_heads, head_dim, index_dim, cfg.sparse_block_size, dtype, DEVICE
    )
    fill_garbage(ref_cache, gen)  # garbage in unwritten slots must not matter
    plug_cache = ref_cache.clone()
    binding = _kernel_binding()
    ker_cache = ref_cache.clone() if binding else None

    pool = KVBlockPool(num_blocks, block_size)
    pool._free = torch.randperm(num_blocks, generator=gen).tolist()  # block tables are not the identity
    prompts = prompts(seqs) if callable(prompts) else (prompts or [None] * len(seqs))
    for i, pl in enumerate(prompts):
        pool.add(i, prompt_length=pl)

    plugin = plugin_for(harness, cfg, layer)
    # One profile for the whole run, one workspace from its bounds (as TensorRT allocates it).
    max_t = max(sum(p[k] if k < len(p) else 0 for p in plans) for k in range(max(map(len, plans))))
    max_w = max(-(-x.length // block_size) for x, _ in seqs)
    bounds = {"T": (1, max_t), "B": (1, len(seqs)), "W": (1, max_w), "NB": (num_blocks, num_blocks)}
    sizes = dict(
        T=max_t,
        H=heads,
        D=head_dim,
        Hkv=kv_heads,
        Di=index_dim,
        NB=num_blocks,
        BSZ=block_size,
        sbs=cfg.sparse_block_size,
        B=len(seqs),
        W=max_w,
    )
    types = {n: TORCH_TYPE[_index_type(index_variant, n)] for n in INDEX_INPUTS}
    profile = io_descs(sizes, index_types=types, dtype=TORCH_TYPE[dtype], bounds=bounds)
    harness.clear()
    assert plugin.configure(profile) == 0, harness.messages()
    ws_bytes = plugin.workspace_size(profile)
    assert ws_bytes > 0, harness.messages()
    workspace = torch.empty(ws_bytes + 1, dtype=torch.uint8, device=DEVICE)[1:]  # deliberately misaligned
    stream = torch.cuda.current_stream().cuda_stream

    done = [0] * len(seqs)
    plans = [list(p) for p in plans]
    worst = 0.0
    while any(plans):
        live = [i for i in range(len(seqs)) if plans[i]]
        step = [(i, plans[i].pop(0)) for i in live]
        batch = pool.schedule(step, device=DEVICE)
        rows = [(i, done[i], done[i] + n) for i, n in step]

        def cat(attr, rows=rows):
            return torch.cat([getattr(seqs[i][0], attr)[a:b] for i, a, b in rows]).contiguous()

        q, k, v, iq, ik = (cat(a) for a in ("q", "k", "v", "iq", "ik"))
        coords = torch.cat([seqs[i][1][a:b] for i, a, b in rows])
        head_cls = seqs[0][0].head_cls
        meta = {n: getattr(batch, n) for n in ("block_tables", "seq_lens", "query_start_loc", "prompt_lens")}
        ref, ref_r = P.paged_dash_attention(
            q, k, v, iq, ik, coords, head_cls, ref_cache, **meta, sp=cfg, layer_idx=layer, return_routing=True
        )

        # The plugin: index inputs in the variant's types, caches in place or into new buffers.
        idx = {"coords": coords, **meta}
        idx = {n: t.to(_index_type(index_variant, n)).contiguous() for n, t in idx.items()}
        cache_in = [getattr(plug_cache, f) for f in CACHE_FIELDS]
        inputs = [
            q,
            k,
            v,
            iq,
            ik,
            idx["coords"],
            head_cls,
            *cache_in,
            idx["block_tables"],
            idx["seq_lens"],
            idx["query_start_loc"],
            idx["prompt_lens"],
        ]
        out = torch.full_like(q, float("nan"))
        if cache_mode == "in_place":
            cache_out = cache_in
            before = None
        else:
            cache_out = [torch.full_like(t, -7) for t in cache_in]
            before = [t.clone() for t in cache_in]
        outputs = [out, *cache_out]
        descs = [(tuple(t.shape), TORCH_TYPE[t.dtype]) for t in inputs + outputs]
        harness.clear()
        assert plugin.on_shape_change(descs) == 0, harness.messages()
        assert plugin.workspace_size([(d, t, "linear", d, d) for d, t in descs]) <= ws_bytes
        status = plugin.enqueue(
            descs, [t.data_ptr() for t in inputs], [t.data_ptr() for t in outputs], workspace.data_ptr(), stream
        )
        assert status == 0, harness.messages()
        torch.cuda.synchronize()
        if before is not None:  # inputs untouched, the new state is in the outputs
            for t, b in zip(cache_in, before):
                assert torch.equal(t, b)
            plug_cache = P.DashKVCache(*cache_out, sparse_block_size=cfg.sparse_block_size)

        routing = None
        if binding is not None:
            k_out, sel = binding.paged_dash_attention_cuda(
                q, k, v, iq, ik, coords, head_cls, ker_cache, **meta, sp=cfg, layer_idx=layer, return_routing=True
            )
            # Same kernels, same inputs: the plugin must add nothing of its own.
            assert torch.equal(out, k_out)
            routing = P.Routing(sel.selected.cpu(), sel.bias.cpu())
            # The output against the reference's attention over the kernels' routing (as in
            # tests/test_cuda.py); the routing against the reference's.
            ref = P.paged_dash_attention(
                q, k, v, iq, ik, coords, head_cls, ref_cache, **meta, sp=cfg, layer_idx=layer, attend_routing=sel
            )
        report = compare_outputs(
            out,
            ref,
            routing,
            P.Routing(ref_r.selected.cpu(), ref_r.bias.cpu(), ref_r.values.cpu(), ref_r.scores.cpu()),
            dtype=dtype,
        )
        assert report.ok, str(report)
        worst = max(worst, report.max_abs_err)
        for i, _, b in rows:
            done[i] = b

    assert_caches_match(plug_cache, ref_cache, dtype)
    if ker_cache is not None:
        for f in CACHE_FIELDS:
            assert torch.equal(getattr(plug_cache, f), getattr(ker_cache, f)), f
    return worst


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("index_variant", INDEX_VARIANTS)
@pytest.mark.parametrize("cache_mode", CACHE_MODES)
def test_enqueue_matches_reference(harness, dtype, shape, index_variant, cache_mode):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _run_case(harness, dtype=dtype, shape=shape, index_variant=index_variant, cache_mode=cache_mode)


def _prompt_lengths(seqs):
    """The response (last 8 tokens) is outside the prompt; the second prompt ends mid-prompt."""
    return [x.length - (8 if i != 1 else 15) for i, (x, _) in enumerate(seqs)]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["prompt_length", "per_layer_lists", "keep_all_16", "truncate_mod", "float32"])
def test_enqueue_config_variants(harness, variant):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    kw, layer, dtype, prompts = {}, 0, torch.bfloat16, None
    if variant in CONFIG_VARIANTS:
        kw, layer = CONFIG_VARIANTS[variant]
    elif variant == "float32":
        dtype = torch.float32
    if variant == "prompt_length":
        prompts = _prompt_lengths
    cfg = make_config(8, **kw)
    shape = (8, 2, 64, 32, 4)
    _run_case(
        harness,
        dtype=dtype,
        shape=shape,
        index_variant="int64",
        cache_mode="in_place",
        cfg=cfg,
        layer=layer,
        prompts=prompts,
    )


@pytest.mark.gpu
def test_enqueue_with_no_new_tokens_copies_caches_only(harness):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    p = plugin_for(harness)
    sizes = dict(BASE_SIZES, T=0)
    descs = io_descs(sizes)
    ins = []
    for dims, t, *_ in descs[:NB_IN]:
        dt = {"float16": torch.float16, "float32": torch.float32, "int32": torch.int32}[t]
        ins.append(
            torch.randn(dims, device=DEVICE).to(dt)
            if dt.is_floating_point
            else torch.randint(0, 9, dims, device=DEVICE, dtype=dt)
        )
    outs = [torch.empty(0, 8, 64, dtype=torch.float16, device=DEVICE)] + [
        torch.zeros_like(ins[i]) for i in OUTPUT_OF[1:]
    ]
    assert (
        p.enqueue(
            descs, [t.data_ptr() for t in ins], [t.data_ptr() for t in outs], 0, torch.cuda.current_stream().cuda_stream
        )
        == 0
    ), harness.messages()
    torch.cuda.synchronize()
    for o, i in zip(outs[1:], OUTPUT_OF[1:]):
        assert torch.equal(o, ins[i])
