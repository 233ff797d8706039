// DashAttention IPluginV3: shapes, formats, workspace, aliasing and enqueue over dash_plan/dash_run_plan.
#include "dash_plugin.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <functional>
#include <new>
#include "dash_text.h"
#include <utility>

#include "dash/dash.h"
#include "dash_index_cast.h"
#include "dash_logging.h"

namespace dash {
namespace trt {

using nvinfer1::DataType;
using nvinfer1::DimsExprs;
using nvinfer1::DynamicPluginTensorDesc;
using nvinfer1::PluginTensorDesc;
using nvinfer1::TensorFormat;

namespace {

// --------------------------------------------------------------------------------- I/O table
constexpr IoSpec kInputs[kNbInputs] = {
    {"q", 3, IoType::kData, {kT, kH, kD}},
    {"k", 3, IoType::kData, {kT, kHkv, kD}},
    {"v", 3, IoType::kData, {kT, kHkv, kD}},
    {"iq", 2, IoType::kData, {kT, kDi}},
    {"ik", 2, IoType::kData, {kT, kDi}},
    {"coords", 2, IoType::kIndex, {kT, kFour}},
    {"head_cls", 1, IoType::kData, {kDi}},
    {"key_cache", 4, IoType::kData, {kNB, kBSZ, kHkv, kD}},
    {"value_cache", 4, IoType::kData, {kNB, kBSZ, kHkv, kD}},
    {"index_key_cache", 3, IoType::kData, {kNB, kBSZ, kDi}},
    {"image_page_cache", 2, IoType::kInt32, {kNB, kBSZ}},
    {"summary_cache", 3, IoType::kFloat32, {kNB, kPER, kDi}},
    {"summary_pages_cache", 3, IoType::kInt32, {kNB, kPER, kThree}},
    {"block_tables", 2, IoType::kIndex, {kB, kW}},
    {"seq_lens", 1, IoType::kIndex, {kB}},
    {"query_start_loc", 1, IoType::kIndex, {kBP1}},
    {"prompt_lens", 1, IoType::kIndex, {kB}},
};

constexpr char const* kOutputNames[kNbOutputs] = {"out",
                                                  "key_cache_out",
                                                  "value_cache_out",
                                                  "index_key_cache_out",
                                                  "image_page_cache_out",
                                                  "summary_cache_out",
                                                  "summary_pages_cache_out"};

constexpr char const* kSymNames[kNbSyms] = {"T (new tokens)", "H (query heads)", "D (head dim)",
                                            "Hkv (KV heads)", "Di (index dim)", "NB (KV blocks)",
                                            "block_size (tokens per KV block)",
                                            "block_size / sparse_block_size", "B (sequences)",
                                            "W (block-table width)", "B + 1", "4", "3"};

//! The index inputs that are converted when int64, with the DashParams field each one feeds.
constexpr int32_t kIndexInputs[] = {kCoords, kBlockTables, kSeqLens, kQueryStartLoc, kPromptLens};

//! Input that output `o` (>= 1) aliases.
constexpr int32_t cacheInputOf(int32_t o) { return kKeyCache + o - 1; }

constexpr size_t kAlign = 256;  // DashParams.workspace alignment (dash.h)
size_t alignUp(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Token counts whose workspace getWorkspaceSize evaluates one by one (see workspaceFor).
constexpr int64_t kTokenScan = 65536;

bool isFloatType(DataType t) { return t == DataType::kFLOAT || t == DataType::kHALF || t == DataType::kBF16; }

char const* typeName(DataType t) {
    switch (t) {
        case DataType::kFLOAT: return "float32";
        case DataType::kHALF: return "float16";
        case DataType::kBF16: return "bfloat16";
        case DataType::kINT32: return "int32";
        case DataType::kINT64: return "int64";
        case DataType::kINT8: return "int8";
        case DataType::kBOOL: return "bool";
        case DataType::kUINT8: return "uint8";
        default: return "an unsupported type";
    }
}

size_t elementSize(DataType t) {
    switch (t) {
        case DataType::kFLOAT:
        case DataType::kINT32: return 4;
        case DataType::kHALF:
        case DataType::kBF16: return 2;
        case DataType::kINT64: return 8;
        default: return 0;
    }
}

int32_t dashDtype(DataType t) {
    return t == DataType::kHALF ? DASH_FLOAT16 : (t == DataType::kBF16 ? DASH_BFLOAT16 : DASH_FLOAT32);
}

int64_t volume(nvinfer1::Dims const& d) {
    int64_t v = 1;
    for (int32_t i = 0; i < d.nbDims; ++i) v *= d.d[i];
    return v;
}

//! Can input `pos` (or output pos - kNbInputs) have type `t`, given q's type `qType`?
bool typeAllowed(int32_t pos, DataType t, DataType qType) {
    if (pos >= kNbInputs) {
        int32_t const o = pos - kNbInputs;
        return o == 0 ? t == qType : typeAllowed(cacheInputOf(o), t, qType);
    }
    switch (kInputs[pos].type) {
        case IoType::kData: return pos == kQ ? isFloatType(t) : t == qType;
        case IoType::kIndex: return t == DataType::kINT32 || t == DataType::kINT64;
        case IoType::kInt32: return t == DataType::kINT32;
        case IoType::kFloat32: return t == DataType::kFLOAT;
    }
    return false;
}

std::string typeRule(int32_t pos) {
    if (pos >= kNbInputs) return pos == kNbInputs ? "q's type" : std::string(kInputs[cacheInputOf(pos - kNbInputs)].name) + "'s type";
    switch (kInputs[pos].type) {
        case IoType::kData: return pos == kQ ? "float32, float16 or bfloat16" : "q's type";
        case IoType::kIndex: return "int32 or int64";
        case IoType::kInt32: return "int32";
        case IoType::kFloat32: return "float32";
    }
    return "?";
}

//! Ranks of the inputs, as `rankOf(i)` gives them.
bool checkRanks(std::function<int32_t(int32_t)> const& rankOf, std::string& error) {
    for (int32_t i = 0; i < kNbInputs; ++i) {
        if (rankOf(i) != kInputs[i].rank) {
            dash::trt::Text os;
            os << "input " << i << " (" << kInputs[i].name << ") must have rank " << kInputs[i].rank << ", got "
               << rankOf(i);
            error = os.str();
            return false;
        }
    }
    return true;
}

//! The dimension relations of the I/O table; `dimOf(i, axis)` < 0 means "not known yet".
bool checkShapes(std::function<int64_t(int32_t, int32_t)> const& dimOf, DashAttributes const& attrs, std::string& error) {
    int64_t const sparseBlockSize = attrs.integer(AttrId::kSparseBlockSize);
    std::array<int64_t, kNbSyms> value;
    std::array<int32_t, kNbSyms> fromInput;
    std::array<int32_t, kNbSyms> fromAxis;
    value.fill(-1);
    fromInput.fill(-1);
    fromAxis.fill(-1);
    value[kFour] = 4;
    value[kThree] = 3;
    for (int32_t i = 0; i < kNbInputs; ++i) {
        for (int32_t a = 0; a < kInputs[i].rank; ++a) {
            int64_t const got = dimOf(i, a);
            if (got < 0) continue;
            Sym const s = kInputs[i].dims[a];
            if (value[s] < 0) {
                value[s] = got, fromInput[s] = i, fromAxis[s] = a;
                continue;
            }
            if (value[s] != got) {
                dash::trt::Text os;
                os << kInputs[i].name << " dim " << a << " is " << got << ", but ";
                if (fromInput[s] >= 0)
                    os << kInputs[fromInput[s]].name << " dim " << fromAxis[s] << " (" << kSymNames[s] << ") is "
                       << value[s];
                else
                    os << "it must be " << value[s];
                error = os.str();
                return false;
            }
        }
    }
    int64_t const indexDim = attrs.integer(AttrId::kSparseIndexDim);
    if (value[kDi] >= 0 && value[kDi] != indexDim) {
        dash::trt::Text os;
        os << kInputs[fromInput[kDi]].name << " dim " << fromAxis[kDi] << " (Di) is " << value[kDi]
           << ", but attribute sparse_index_dim is " << indexDim;
        error = os.str();
        return false;
    }
    if (value[kB] >= 0 && value[kBP1] >= 0 && value[kBP1] != value[kB] + 1) {
        dash::trt::Text os;
        os << "query_start_loc has " << value[kBP1] << " entries, but block_tables has " << value[kB]
           << " rows (B); it needs B + 1";
        error = os.str();
        return false;
    }
    if (value[kBSZ] >= 0 && value[kPER] >= 0 && sparseBlockSize > 0 &&
        value[kPER] != (value[kBSZ] + sparseBlockSize - 1) / sparseBlockSize) {
        dash::trt::Text os;
        os << "summary_cache dim 1 is " << value[kPER] << ", but block_size " << value[kBSZ]
           << " / sparse_block_size " << sparseBlockSize << " needs " << (value[kBSZ] + sparseBlockSize - 1) / sparseBlockSize;
        error = os.str();
        return false;
    }
    return true;
}

//! The sizes DashParams needs, read from per-input dims.
struct Sizes {
    int64_t T{0}, H{0}, D{0}, Hkv{0}, Di{0}, NB{0}, BSZ{0}, B{0}, W{0};
};

Sizes sizesOf(std::function<int64_t(int32_t, int32_t)> const& dimOf) {
    Sizes s;
    s.T = dimOf(kQ, 0), s.H = dimOf(kQ, 1), s.D = dimOf(kQ, 2);
    s.Hkv = dimOf(kK, 1), s.Di = dimOf(kIQ, 1);
    s.NB = dimOf(kKeyCache, 0), s.BSZ = dimOf(kKeyCache, 1);
    s.B = dimOf(kBlockTables, 0), s.W = dimOf(kBlockTables, 1);
    return s;
}

bool fitsInt32(Sizes const& s, std::string& error) {
    int64_t const v[] = {s.T, s.H, s.D, s.Hkv, s.Di, s.NB, s.BSZ, s.B, s.W};
    for (int64_t x : v) {
        if (x < 0 || x > INT32_MAX) {
            error = "a dimension is negative or does not fit in int32: " + std::to_string(x);
            return false;
        }
    }
    return true;
}

// dash_validate only tests pointers for NULL; this one is never dereferenced.
void* const kShapeOnly = reinterpret_cast<void*>(kAlign);

//! DashParams of these sizes and this configuration, every pointer kShapeOnly.
DashParams shapeParams(Sizes const& s, DataType qType, DashAttributes const& attrs) {
    DashParams p{};
    p.num_tokens = static_cast<int32_t>(s.T);
    p.num_seqs = static_cast<int32_t>(s.B);
    p.num_heads = static_cast<int32_t>(s.H);
    p.num_kv_heads = static_cast<int32_t>(s.Hkv);
    p.head_dim = static_cast<int32_t>(s.D);
    p.index_dim = static_cast<int32_t>(s.Di);
    p.num_blocks = static_cast<int32_t>(s.NB);
    p.block_size = static_cast<int32_t>(s.BSZ);
    p.table_width = static_cast<int32_t>(s.W);
    // Any one sequence has at most all of the call's tokens; the host cannot know more without
    // a device sync (the PyTorch binding passes T as well).
    p.max_new_tokens = static_cast<int32_t>(s.T);
    p.dtype = dashDtype(qType);
    attrs.fillConfig(p);
    p.q = p.k = p.v = p.iq = p.ik = p.head_cls = kShapeOnly;
    p.coords = p.block_tables = p.seq_lens = p.query_start_loc = p.prompt_lens = static_cast<int32_t const*>(kShapeOnly);
    p.key_cache = p.value_cache = p.index_key_cache = p.out = kShapeOnly;
    p.image_page_cache = p.summary_pages_cache = static_cast<int32_t*>(kShapeOnly);
    p.summary_cache = static_cast<float*>(kShapeOnly);
    return p;
}

std::string dashError(DashStatus status) {
    return std::string(dash_status_string(status)) + ": " + dash_last_error_message();
}

//! Bytes of int32 copies of the int64 index inputs (each 256-byte aligned).
size_t indexBytes(Sizes const& s, std::function<DataType(int32_t)> const& typeOf) {
    size_t bytes = 0;
    for (int32_t i : kIndexInputs) {
        if (typeOf(i) != DataType::kINT64) continue;
        int64_t count = 0;
        switch (i) {
            case kCoords: count = s.T * DASH_NUM_COORDS; break;
            case kBlockTables: count = s.B * s.W; break;
            case kQueryStartLoc: count = s.B + 1; break;
            default: count = s.B; break;
        }
        bytes += alignUp(static_cast<size_t>(count) * sizeof(int32_t));
    }
    return bytes;
}

bool checkCounts(int32_t nbInputs, int32_t nbOutputs, std::string& error) {
    if (nbInputs == kNbInputs && nbOutputs == kNbOutputs) return true;
    error = "expects " + std::to_string(kNbInputs) + " inputs and " + std::to_string(kNbOutputs) + " outputs, got " +
            std::to_string(nbInputs) + " and " + std::to_string(nbOutputs);
    return false;
}

bool checkTypes(std::function<DataType(int32_t)> const& typeOf, int32_t nbPositions, std::string& error) {
    DataType const qType = typeOf(kQ);
    for (int32_t pos = 0; pos < nbPositions; ++pos) {
        if (!typeAllowed(pos, typeOf(pos), qType)) {
            std::string const name = pos < kNbInputs ? kInputs[pos].name : kOutputNames[pos - kNbInputs];
            error = std::string(pos < kNbInputs ? "input " : "output ") + name + " is " + typeName(typeOf(pos)) +
                    "; it must be " + typeRule(pos);
            return false;
        }
    }
    return true;
}

}  // namespace

IoSpec const& inputSpec(int32_t index) noexcept { return kInputs[index]; }
char const* outputName(int32_t index) noexcept { return kOutputNames[index]; }

// ----------------------------------------------------------------------------------- plugin
DashAttentionPlugin::DashAttentionPlugin(std::string layerName, std::string pluginNamespace,
                                         DashAttributes const& attrs)
    : mLayerName(std::move(layerName)), mNamespace(std::move(pluginNamespace)), mAttrs(attrs) {
    mMetadata = mAttrs.describe();
}

DashAttentionPlugin::DashAttentionPlugin(DashAttentionPlugin const& other)
    : nvinfer1::IPluginV3(other),
      nvinfer1::IPluginV3OneCore(other),
      nvinfer1::IPluginV3OneBuildV2(other),
      nvinfer1::IPluginV3OneRuntime(other),
      mLayerName(other.mLayerName),
      mNamespace(other.mNamespace),
      mAttrs(other.mAttrs),
      mMetadata(other.mMetadata),
      mWorkspaceBound(other.mWorkspaceBound) {}

std::string DashAttentionPlugin::where() const { return "layer '" + mLayerName + "'"; }

int32_t DashAttentionPlugin::fail(std::string const& method, std::string const& message) const noexcept {
    try {
        logError(where() + ": " + method + ": " + message);
    } catch (...) {
    }
    return -1;
}

nvinfer1::IPluginCapability* DashAttentionPlugin::getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept {
    switch (type) {
        case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
        case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuildV2*>(this);
        case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
    }
    return nullptr;
}

nvinfer1::IPluginV3* DashAttentionPlugin::clone() noexcept {
    try {
        return new DashAttentionPlugin(*this);
    } catch (std::exception const& e) {
        fail("clone", e.what());
    } catch (...) {
        fail("clone", "unknown exception");
    }
    return nullptr;
}

char const* DashAttentionPlugin::getPluginName() const noexcept { return kPluginName; }
char const* DashAttentionPlugin::getPluginVersion() const noexcept { return kPluginVersion; }
char const* DashAttentionPlugin::getPluginNamespace() const noexcept { return mNamespace.c_str(); }

int32_t DashAttentionPlugin::getNbOutputs() const noexcept { return kNbOutputs; }

int32_t DashAttentionPlugin::getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                                                int32_t nbInputs) const noexcept {
    try {
        std::string error;
        if (!checkCounts(nbInputs, nbOutputs, error)) return fail("getOutputDataTypes", error);
        if (outputTypes == nullptr || inputTypes == nullptr) return fail("getOutputDataTypes", "NULL type array");
        outputTypes[0] = inputTypes[kQ];
        for (int32_t o = 1; o < kNbOutputs; ++o) outputTypes[o] = inputTypes[cacheInputOf(o)];
        return 0;
    } catch (std::exception const& e) {
        return fail("getOutputDataTypes", e.what());
    } catch (...) {
        return fail("getOutputDataTypes", "unknown exception");
    }
}

int32_t DashAttentionPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* shapeInputs,
                                             int32_t nbShapeInputs, DimsExprs* outputs, int32_t nbOutputs,
                                             nvinfer1::IExprBuilder& exprBuilder) noexcept {
    (void)shapeInputs;
    (void)exprBuilder;  // every output shape is an input shape
    try {
        std::string error;
        if (!checkCounts(nbInputs, nbOutputs, error)) return fail("getOutputShapes", error);
        if (nbShapeInputs != 0) return fail("getOutputShapes", "takes no shape inputs, got " + std::to_string(nbShapeInputs));
        if (inputs == nullptr || outputs == nullptr) return fail("getOutputShapes", "NULL shape array");
        if (!checkRanks([&](int32_t i) { return inputs[i].nbDims; }, error)) return fail("getOutputShapes", error);
        auto constant = [&](int32_t i, int32_t a) -> int64_t {
            nvinfer1::IDimensionExpr const* e = inputs[i].d[a];
            return e != nullptr && e->isConstant() ? e->getConstantValue() : -1;
        };
        if (!checkShapes(constant, mAttrs, error))
            return fail("getOutputShapes", error);
        outputs[0] = inputs[kQ];
        for (int32_t o = 1; o < kNbOutputs; ++o) outputs[o] = inputs[cacheInputOf(o)];
        return 0;
    } catch (std::exception const& e) {
        return fail("getOutputShapes", e.what());
    } catch (...) {
        return fail("getOutputShapes", "unknown exception");
    }
}

bool DashAttentionPlugin::supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut,
                                                    int32_t nbInputs, int32_t nbOutputs) noexcept {
    // Called many times while TensorRT searches formats: no logging here.
    if (inOut == nullptr || nbInputs != kNbInputs || nbOutputs != kNbOutputs || pos < 0 ||
        pos >= kNbInputs + kNbOutputs)
        return false;
    PluginTensorDesc const& desc = inOut[pos].desc;
    if (desc.format != TensorFormat::kLINEAR) return false;
    // Positions after q may depend on q's type (inOut[0]); TensorRT has fixed it by then.
    return typeAllowed(pos, desc.type, pos == kQ ? desc.type : inOut[kQ].desc.type);
}

int32_t DashAttentionPlugin::configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs,
                                             DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept {
    try {
        std::string error;
        if (!checkCounts(nbInputs, nbOutputs, error)) return fail("configurePlugin", error);
        if (in == nullptr || out == nullptr) return fail("configurePlugin", "NULL descriptor array");
        if (!checkRanks([&](int32_t i) { return in[i].desc.dims.nbDims; }, error)) return fail("configurePlugin", error);
        auto typeOf = [&](int32_t pos) { return pos < kNbInputs ? in[pos].desc.type : out[pos - kNbInputs].desc.type; };
        if (!checkTypes(typeOf, kNbInputs + kNbOutputs, error)) return fail("configurePlugin", error);
        // Static dims as declared, then the profile's bounds.
        if (!checkShapes([&](int32_t i, int32_t a) { return in[i].desc.dims.d[a]; }, mAttrs, error) ||
            !checkShapes([&](int32_t i, int32_t a) { return in[i].min.d[a]; }, mAttrs, error) ||
            !checkShapes([&](int32_t i, int32_t a) { return in[i].max.d[a]; }, mAttrs, error))
            return fail("configurePlugin", error);
        // The kernels' own limits (head dims, GQA group, block sizes, context length) at the
        // profile's largest shapes.
        Sizes const maxSizes = sizesOf([&](int32_t i, int32_t a) { return in[i].max.d[a]; });
        if (!fitsInt32(maxSizes, error)) return fail("configurePlugin", error);
        DashParams const p = shapeParams(maxSizes, in[kQ].desc.type, mAttrs);
        DashStatus const status = dash_validate(&p);
        if (status != DASH_OK) return fail("configurePlugin", dashError(status));
        // What getWorkspaceSize will answer for this profile: the bound enqueue checks.
        if (workspaceFor(in, error) == 0) return fail("configurePlugin", error);
        return 0;
    } catch (std::exception const& e) {
        return fail("configurePlugin", e.what());
    } catch (...) {
        return fail("configurePlugin", "unknown exception");
    }
}

size_t DashAttentionPlugin::workspaceFor(DynamicPluginTensorDesc const* in, std::string& error) const {
    auto maxDim = [&](int32_t i, int32_t a) { return in[i].max.d[a]; };
    Sizes const maxSizes = sizesOf(maxDim);
    if (!fitsInt32(maxSizes, error)) return 0;
    int64_t const minT = std::max<int64_t>(0, in[kQ].min.d[0]);
    DataType const qType = in[kQ].desc.type;
    auto typeOf = [&](int32_t i) { return in[i].desc.type; };

    // Every input of the size: all nine dims (the KV block count sizes the block-major
    // buffers), the smallest token count, q's type and each index input's type.
    dash::trt::Text key;
    key << maxSizes.T << ',' << maxSizes.H << ',' << maxSizes.D << ',' << maxSizes.Hkv << ',' << maxSizes.Di << ','
        << maxSizes.NB << ',' << maxSizes.BSZ << ',' << maxSizes.B << ',' << maxSizes.W << ',' << minT << ','
        << static_cast<int32_t>(qType);
    for (int32_t i : kIndexInputs) key << ',' << static_cast<int32_t>(typeOf(i));
    std::lock_guard<std::mutex> lock(mWorkspaceMutex);
    if (key.str() == mWorkspaceKey) return mWorkspaceBytes;

    // dash_workspace_size is not monotone in the token count: the split-K scratch of the
    // attention stage is used only while T * Hkv is small, and is then larger for smaller T.
    // Take the maximum over every token count of the profile (the first kTokenScan of them when
    // the range is wider: beyond a few thousand tokens there is no split-K and the size grows
    // with T, so the largest count covers the rest).
    DashParams p = shapeParams(maxSizes, qType, mAttrs);
    size_t dashBytes = 0;
    auto account = [&](int64_t tokens) {
        p.num_tokens = p.max_new_tokens = static_cast<int32_t>(tokens);
        size_t bytes = 0;
        DashStatus const status = dash_workspace_size(&p, &bytes);
        if (status != DASH_OK) {
            error = dashError(status);
            return false;
        }
        dashBytes = std::max(dashBytes, alignUp(bytes));
        return true;
    };
    int64_t const last = std::min(maxSizes.T, minT + kTokenScan - 1);
    auto scan = [&]() {
        for (int64_t t = minT; t <= last; ++t)
            if (!account(t)) return false;
        return last >= maxSizes.T || account(maxSizes.T);
    };
    if (!scan()) return 0;
    // Nor is it monotone in the table width: past DASH_QUERY_MAJOR_MAX_BLOCKS sparse blocks the
    // query-major tiles (and their buffers) are off, so a call with a narrower table than the
    // profile's widest can need more. Evaluate the widest width at or below that limit too.
    int64_t const blocksPerColumn = std::max<int64_t>(1, maxSizes.BSZ / std::max<int32_t>(1, p.sparse_block_size));
    int64_t const qmWidth = DASH_QUERY_MAJOR_MAX_BLOCKS / blocksPerColumn;
    int64_t const minW = std::max<int64_t>(1, in[kBlockTables].min.d[1]);
    if (maxSizes.W > qmWidth && qmWidth >= minW) {
        p.table_width = static_cast<int32_t>(qmWidth);
        if (!scan()) return 0;
    }
    size_t const total = kAlign /* to align TensorRT's pointer */ + dashBytes + indexBytes(maxSizes, typeOf);
    mWorkspaceKey = key.str();
    mWorkspaceBytes = total;
    // The largest answer: with several profiles, TensorRT sizes each one's workspace by its own
    // answer, and its own shape checks keep a call inside its profile.
    mWorkspaceBound = std::max(mWorkspaceBound, total);
    return total;
}

size_t DashAttentionPlugin::getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                                             DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept {
    try {
        std::string error;
        if (!checkCounts(nbInputs, nbOutputs, error) || inputs == nullptr) {
            fail("getWorkspaceSize", error.empty() ? "NULL descriptor array" : error);
            return 0;
        }
        (void)outputs;
        size_t const bytes = workspaceFor(inputs, error);
        if (bytes == 0) fail("getWorkspaceSize", error);
        return bytes;
    } catch (std::exception const& e) {
        fail("getWorkspaceSize", e.what());
    } catch (...) {
        fail("getWorkspaceSize", "unknown exception");
    }
    return 0;
}

int32_t DashAttentionPlugin::getAliasedInput(int32_t outputIndex) noexcept {
    // Output 0 (attention) is new; outputs 1..6 are the caches, written in place.
    return outputIndex >= 1 && outputIndex < kNbOutputs ? cacheInputOf(outputIndex) : -1;
}

char const* DashAttentionPlugin::getTimingCacheID() noexcept {
    // Shapes and formats are added by TensorRT; the attributes are the rest of the state.
    return mMetadata.c_str();
}

char const* DashAttentionPlugin::getMetadataString() noexcept { return mMetadata.c_str(); }

int32_t DashAttentionPlugin::onShapeChange(PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* out,
                                           int32_t nbOutputs) noexcept {
    try {
        std::string error;
        if (!checkCounts(nbInputs, nbOutputs, error)) return fail("onShapeChange", error);
        if (in == nullptr || out == nullptr) return fail("onShapeChange", "NULL descriptor array");
        if (!checkRanks([&](int32_t i) { return in[i].dims.nbDims; }, error)) return fail("onShapeChange", error);
        auto typeOf = [&](int32_t pos) { return pos < kNbInputs ? in[pos].type : out[pos - kNbInputs].type; };
        if (!checkTypes(typeOf, kNbInputs + kNbOutputs, error)) return fail("onShapeChange", error);
        auto dimOf = [&](int32_t i, int32_t a) { return in[i].dims.d[a]; };
        if (!checkShapes(dimOf, mAttrs, error)) return fail("onShapeChange", error);
        Sizes const sizes = sizesOf(dimOf);
        if (!fitsInt32(sizes, error)) return fail("onShapeChange", error);
        if (sizes.T > 0) {
            DashParams const p = shapeParams(sizes, in[kQ].type, mAttrs);
            DashStatus const status = dash_validate(&p);
            if (status != DASH_OK) return fail("onShapeChange", dashError(status));
        }
        return 0;
    } catch (std::exception const& e) {
        return fail("onShapeChange", e.what());
    } catch (...) {
        return fail("onShapeChange", "unknown exception");
    }
}

int32_t DashAttentionPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc,
                                     void const* const* inputs, void* const* outputs, void* workspace,
                                     cudaStream_t stream) noexcept {
    try {
        if (inputDesc == nullptr || outputDesc == nullptr || inputs == nullptr || outputs == nullptr)
            return fail("enqueue", "NULL descriptor or pointer array");
        // onShapeChange has checked these already; they are cheap, and a wrong shape would
        // otherwise become an out-of-bounds access.
        std::string error;
        if (!checkRanks([&](int32_t i) { return inputDesc[i].dims.nbDims; }, error)) return fail("enqueue", error);
        auto typeOf = [&](int32_t pos) { return pos < kNbInputs ? inputDesc[pos].type : outputDesc[pos - kNbInputs].type; };
        if (!checkTypes(typeOf, kNbInputs + kNbOutputs, error)) return fail("enqueue", error);
        auto dimOf = [&](int32_t i, int32_t a) { return inputDesc[i].dims.d[a]; };
        if (!checkShapes(dimOf, mAttrs, error)) return fail("enqueue", error);
        Sizes const sizes = sizesOf(dimOf);
        if (!fitsInt32(sizes, error)) return fail("enqueue", error);
        DataType const qType = inputDesc[kQ].type;

        DashParams p = shapeParams(sizes, qType, mAttrs);
        p.q = inputs[kQ], p.k = inputs[kK], p.v = inputs[kV], p.iq = inputs[kIQ], p.ik = inputs[kIK];
        p.head_cls = inputs[kHeadCls];
        p.key_cache = outputs[1], p.value_cache = outputs[2], p.index_key_cache = outputs[3];
        p.image_page_cache = static_cast<int32_t*>(outputs[4]);
        p.summary_cache = static_cast<float*>(outputs[5]);
        p.summary_pages_cache = static_cast<int32_t*>(outputs[6]);
        p.out = outputs[0];
        int32_t const** indexFields[] = {&p.coords, &p.block_tables, &p.seq_lens, &p.query_start_loc, &p.prompt_lens};
        for (size_t j = 0; j < sizeof(kIndexInputs) / sizeof(kIndexInputs[0]); ++j)
            *indexFields[j] = static_cast<int32_t const*>(inputs[kIndexInputs[j]]);

        // Validate everything before touching any buffer.
        size_t dashBytes = 0;
        if (sizes.T > 0) {
            // Planned once per shape: the next enqueue of the same shapes (every decode step of
            // a layer, every layer of a step) reuses the plan. A plugin instance serves one
            // execution context (attachToContext clones it), so one device and one stream order.
            if (!dash_plan_matches(&p, &mPlan)) {
                DashStatus const status = dash_plan(&p, &mPlan);
                if (status != DASH_OK) return fail("enqueue", dashError(status));
            }
            dashBytes = dash_plan_workspace_size(&mPlan);
            if (workspace == nullptr) return fail("enqueue", "no workspace (getWorkspaceSize failed?)");
            // Never write past the workspace TensorRT allocated (getWorkspaceSize's answer for
            // the profile): shapes outside it, or an engine built for other sizes, fail here.
            size_t const needed = kAlign + alignUp(dashBytes) + indexBytes(sizes, [&](int32_t i) { return inputDesc[i].type; });
            if (mWorkspaceBound > 0 && needed > mWorkspaceBound)
                return fail("enqueue", "this call needs " + std::to_string(needed) + " bytes of workspace, TensorRT "
                                       "allocated " + std::to_string(mWorkspaceBound) +
                                       " (getWorkspaceSize for the profile): the shapes are outside the profile the "
                                       "engine was built for");
        }

        // The caches: in place when TensorRT aliased them (or the caller bound the same buffer
        // to input and output); otherwise the output starts as a copy of the input.
        for (int32_t o = 1; o < kNbOutputs; ++o) {
            int32_t const i = cacheInputOf(o);
            if (outputs[o] == inputs[i]) continue;
            size_t const bytes = static_cast<size_t>(volume(inputDesc[i].dims)) * elementSize(inputDesc[i].type);
            if (bytes == 0) continue;
            if (outputs[o] == nullptr || inputs[i] == nullptr)
                return fail("enqueue", std::string("NULL buffer for cache ") + kInputs[i].name);
            cudaError_t const err = cudaMemcpyAsync(outputs[o], inputs[i], bytes, cudaMemcpyDeviceToDevice, stream);
            if (err != cudaSuccess)
                return fail("enqueue", std::string("copying ") + kInputs[i].name + ": " + cudaGetErrorString(err));
        }
        if (sizes.T == 0) return 0;  // nothing to write or attend

        // TensorRT's workspace pointer carries no alignment promise we rely on: getWorkspaceSize
        // asked for kAlign extra bytes.
        auto const base = (reinterpret_cast<uintptr_t>(workspace) + kAlign - 1) / kAlign * kAlign;
        p.workspace = reinterpret_cast<void*>(base);
        p.workspace_size = dashBytes;
        uintptr_t cursor = base + alignUp(dashBytes);

        IndexCastJobs jobs{};
        for (size_t j = 0; j < sizeof(kIndexInputs) / sizeof(kIndexInputs[0]); ++j) {
            int32_t const i = kIndexInputs[j];
            if (inputDesc[i].type != DataType::kINT64) continue;
            int32_t* dst = reinterpret_cast<int32_t*>(cursor);
            int64_t const count = volume(inputDesc[i].dims);
            jobs.src[jobs.n] = static_cast<int64_t const*>(inputs[i]);
            jobs.dst[jobs.n] = dst;
            jobs.count[jobs.n] = count;
            ++jobs.n;
            *indexFields[j] = dst;
            cursor += alignUp(static_cast<size_t>(count) * sizeof(int32_t));
        }
        cudaError_t const castErr = castIndicesToInt32(jobs, stream);
        if (castErr != cudaSuccess)
            return fail("enqueue", std::string("int64 index conversion: ") + cudaGetErrorString(castErr));

        DashStatus const status = dash_run_plan(&p, &mPlan, stream);
        if (status != DASH_OK) return fail("enqueue", dashError(status));
        return 0;
    } catch (std::exception const& e) {
        return fail("enqueue", e.what());
    } catch (...) {
        return fail("enqueue", "unknown exception");
    }
}

nvinfer1::IPluginV3* DashAttentionPlugin::attachToContext(nvinfer1::IPluginResourceContext* context) noexcept {
    (void)context;  // no per-context resources: scratch comes from TensorRT's workspace
    return clone();
}

nvinfer1::PluginFieldCollection const* DashAttentionPlugin::getFieldsToSerialize() noexcept {
    try {
        // The attributes, then the workspace bound when it is known (the runtime checks it).
        nvinfer1::PluginFieldCollection const* attrs = mSerialized.build(mAttrs);
        mSerializedFields.assign(attrs->fields, attrs->fields + attrs->nbFields);
        if (mWorkspaceBound > 0) {
            mSerializedBound = static_cast<int64_t>(mWorkspaceBound);
            mSerializedFields.emplace_back(kWorkspaceField, &mSerializedBound, nvinfer1::PluginFieldType::kINT64, 1);
        }
        mSerializedCollection.nbFields = static_cast<int32_t>(mSerializedFields.size());
        mSerializedCollection.fields = mSerializedFields.data();
        return &mSerializedCollection;
    } catch (std::exception const& e) {
        fail("getFieldsToSerialize", e.what());
    } catch (...) {
        fail("getFieldsToSerialize", "unknown exception");
    }
    return nullptr;
}

// ---------------------------------------------------------------------------------- creator
char const* DashAttentionCreator::getPluginName() const noexcept { return kPluginName; }
char const* DashAttentionCreator::getPluginVersion() const noexcept { return kPluginVersion; }
char const* DashAttentionCreator::getPluginNamespace() const noexcept { return mNamespace.c_str(); }

nvinfer1::PluginFieldCollection const* DashAttentionCreator::getFieldNames() noexcept { return attributeFieldNames(); }

nvinfer1::IPluginV3* DashAttentionCreator::createPlugin(char const* name, nvinfer1::PluginFieldCollection const* fc,
                                                        nvinfer1::TensorRTPhase phase) noexcept {
    std::string const layer = name != nullptr ? name : "";
    try {
        char const* where = phase == nvinfer1::TensorRTPhase::kBUILD ? "build" : "runtime";
        // The serialized workspace bound is not an attribute: take it out before parsing.
        std::vector<nvinfer1::PluginField> fields;
        int64_t bound = 0;
        for (int32_t i = 0; fc != nullptr && fc->fields != nullptr && i < fc->nbFields; ++i) {
            nvinfer1::PluginField const& f = fc->fields[i];
            if (f.name != nullptr && std::string(f.name) == kWorkspaceField) {
                if (f.type != nvinfer1::PluginFieldType::kINT64 || f.length != 1 || f.data == nullptr ||
                    *static_cast<int64_t const*>(f.data) <= 0) {
                    logError("layer '" + layer + "': createPlugin (" + where + "): field '" + kWorkspaceField +
                             "' must be one positive INT64");
                    return nullptr;
                }
                bound = *static_cast<int64_t const*>(f.data);
                continue;
            }
            fields.push_back(f);
        }
        nvinfer1::PluginFieldCollection rest{};
        rest.nbFields = static_cast<int32_t>(fields.size());
        rest.fields = fields.data();
        DashAttributes attrs;
        std::string error;
        if (!attrs.parse(fc == nullptr ? nullptr : &rest, error)) {
            logError("layer '" + layer + "': createPlugin (" + where + "): " + error);
            return nullptr;
        }
        auto* plugin = new DashAttentionPlugin(layer, mNamespace, attrs);
        plugin->mWorkspaceBound = static_cast<size_t>(bound);
        return plugin;
    } catch (std::exception const& e) {
        logError("layer '" + layer + "': createPlugin: " + e.what());
    } catch (...) {
        logError("layer '" + layer + "': createPlugin: unknown exception");
    }
    return nullptr;
}

}  // namespace trt
}  // namespace dash
