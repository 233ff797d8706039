/*
 * libdash_trt_plugin_harness.so: drives the DashAttention plugin the way TensorRT would, without
 * the TensorRT runtime, for tests/test_trt_harness.py (ctypes).
 *
 * It gets the creator through libdash_trt_plugin.so's exported getCreators() (the same entry
 * point IPluginRegistry::loadLibrary uses), registers a logger finder that captures every message
 * the plugin logs, creates plugins from PluginFieldCollections as the ONNX parser or a
 * deserialised engine would, and calls the build and runtime methods with caller-provided
 * descriptors and device pointers. IExprBuilder / IDimensionExpr / IPluginResourceContext are
 * small stand-ins (TensorRT offers no public way to construct them).
 *
 * Tensor descriptors cross the C ABI as DashHarnessTensor; types and formats are TensorRT's
 * DataType / TensorFormat values, which Python looks up by name (dash_harness_type_code).
 */
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include "../trt/dash_text.h"
#include <string>
#include <vector>

#include "NvInferRuntime.h"

#define DASH_HARNESS_API extern "C" __attribute__((visibility("default")))

// The plugin library's entry points (linked: libdash_trt_plugin.so).
extern "C" nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);
extern "C" void setLoggerFinder(nvinfer1::ILoggerFinder* finder);

namespace {

constexpr int32_t kHarnessAbi = 2;
constexpr int32_t kMaxDims = nvinfer1::Dims::MAX_DIMS;
constexpr int32_t kMaxTensors = 64;

// --------------------------------------------------------------------------- message capture
std::mutex gMessageMutex;
std::string gMessages;
std::string gMessagesCopy;  // what dash_harness_messages returned last (stays valid until the next call)

void record(char const* tag, std::string const& text) {
    std::lock_guard<std::mutex> lock(gMessageMutex);
    gMessages += std::string("[") + tag + "] " + text + "\n";
}

class CaptureLogger final : public nvinfer1::ILogger {
public:
    void log(Severity severity, nvinfer1::AsciiChar const* msg) noexcept override {
        char const* tag = "?";
        switch (severity) {
            case Severity::kINTERNAL_ERROR: tag = "F"; break;
            case Severity::kERROR: tag = "E"; break;
            case Severity::kWARNING: tag = "W"; break;
            case Severity::kINFO: tag = "I"; break;
            case Severity::kVERBOSE: tag = "V"; break;
        }
        try {
            record(tag, msg != nullptr ? msg : "");
        } catch (...) {
        }
    }
};

class CaptureFinder final : public nvinfer1::ILoggerFinder {
public:
    nvinfer1::ILogger* findLogger() override { return &mLogger; }

private:
    CaptureLogger mLogger;
};

CaptureFinder gFinder;
std::once_flag gInit;

//! The creator the harness calls (dash_harness_select_creator): DashAttention unless told otherwise.
std::string gCreatorName = "DashAttention";

nvinfer1::IPluginCreatorV3One* creator() {
    std::call_once(gInit, [] { setLoggerFinder(&gFinder); });
    int32_t n = 0;
    nvinfer1::IPluginCreatorInterface* const* list = getCreators(n);
    for (int32_t i = 0; i < n; ++i) {
        nvinfer1::InterfaceInfo const info = list[i]->getInterfaceInfo();
        if (std::strcmp(info.kind, "PLUGIN CREATOR_V3ONE") == 0 &&
            gCreatorName == static_cast<nvinfer1::IPluginCreatorV3One*>(list[i])->getPluginName())
            return static_cast<nvinfer1::IPluginCreatorV3One*>(list[i]);
    }
    record("E", "harness: getCreators() has no " + gCreatorName + " IPluginCreatorV3One");
    return nullptr;
}

// ------------------------------------------------------------------ IExprBuilder stand-in
// A dimension is a constant (value >= 0) or an unknown runtime value (value < 0).
class HarnessDim final : public nvinfer1::IDimensionExpr {
public:
    explicit HarnessDim(int64_t value) {
        mStore.value = value;
        mImpl = &mStore;
    }
    ~HarnessDim() noexcept override = default;

private:
    struct Impl final : nvinfer1::apiv::VDimensionExpr {
        int64_t value{-1};
        bool isConstant() const override { return value >= 0; }
        int64_t getConstantValue() const override {
            return value >= 0 ? value : std::numeric_limits<int64_t>::min();
        }
        bool isSizeTensor() const override { return false; }
    } mStore;
};

class HarnessExprBuilder final : public nvinfer1::IExprBuilder {
public:
    HarnessExprBuilder() {
        mStore.owner = this;
        mImpl = &mStore;
    }
    ~HarnessExprBuilder() noexcept override = default;

    nvinfer1::IDimensionExpr const* make(int64_t value) {
        mDims.emplace_back(value);  // deque: earlier expressions never move
        return &mDims.back();
    }

private:
    struct Impl final : nvinfer1::apiv::VExprBuilder {
        HarnessExprBuilder* owner{nullptr};
        nvinfer1::IDimensionExpr const* constant(int64_t value) override { return owner->make(value); }
        nvinfer1::IDimensionExpr const* operation(nvinfer1::DimensionOperation op, nvinfer1::IDimensionExpr const& a,
                                                  nvinfer1::IDimensionExpr const& b) override {
            if (!a.isConstant() || !b.isConstant()) return owner->make(-1);
            int64_t const x = a.getConstantValue();
            int64_t const y = b.getConstantValue();
            using Op = nvinfer1::DimensionOperation;
            switch (op) {
                case Op::kSUM: return owner->make(x + y);
                case Op::kPROD: return owner->make(x * y);
                case Op::kMAX: return owner->make(x > y ? x : y);
                case Op::kMIN: return owner->make(x < y ? x : y);
                case Op::kSUB: return owner->make(x - y);
                case Op::kEQUAL: return owner->make(x == y ? 1 : 0);
                case Op::kLESS: return owner->make(x < y ? 1 : 0);
                case Op::kFLOOR_DIV: return y != 0 ? owner->make(x / y) : nullptr;
                case Op::kCEIL_DIV: return y != 0 ? owner->make((x + y - 1) / y) : nullptr;
            }
            return nullptr;
        }
        nvinfer1::IDimensionExpr const* declareSizeTensor(int32_t, nvinfer1::IDimensionExpr const&,
                                                          nvinfer1::IDimensionExpr const&) override {
            return nullptr;  // DashAttention has no size-tensor outputs
        }
    } mStore;
    std::deque<HarnessDim> mDims;
};

class HarnessResourceContext final : public nvinfer1::IPluginResourceContext {
public:
    nvinfer1::IGpuAllocator* getGpuAllocator() const noexcept override { return nullptr; }
    nvinfer1::IErrorRecorder* getErrorRecorder() const noexcept override { return nullptr; }
};

// ------------------------------------------------------------------------------- plumbing
struct Handle {
    nvinfer1::IPluginV3* plugin{nullptr};
    nvinfer1::IPluginV3OneCore* core() const {
        return static_cast<nvinfer1::IPluginV3OneCore*>(plugin->getCapabilityInterface(nvinfer1::PluginCapabilityType::kCORE));
    }
    nvinfer1::IPluginV3OneBuildV2* build() const {
        auto* cap = plugin->getCapabilityInterface(nvinfer1::PluginCapabilityType::kBUILD);
        if (cap == nullptr) return nullptr;
        // TensorRT checks the interface version before using getAliasedInput; so does the harness.
        nvinfer1::InterfaceInfo const info = static_cast<nvinfer1::IPluginV3OneBuild*>(cap)->getInterfaceInfo();
        if (std::strcmp(info.kind, "PLUGIN_V3ONE_BUILD") != 0 || info.major < 2) return nullptr;
        return static_cast<nvinfer1::IPluginV3OneBuildV2*>(cap);
    }
    nvinfer1::IPluginV3OneRuntime* runtime() const {
        return static_cast<nvinfer1::IPluginV3OneRuntime*>(
            plugin->getCapabilityInterface(nvinfer1::PluginCapabilityType::kRUNTIME));
    }
};

//! The build capability, or nullptr with a message when it is missing or not the V2 interface.
nvinfer1::IPluginV3OneBuildV2* buildOf(Handle const* h) {
    nvinfer1::IPluginV3OneBuildV2* b = h->build();
    if (b == nullptr) record("E", "harness: the plugin has no IPluginV3OneBuildV2 build capability");
    return b;
}

int32_t copyText(std::string const& text, char* buf, int32_t cap) {
    if (buf != nullptr && cap > 0) {
        size_t const n = text.size() < static_cast<size_t>(cap - 1) ? text.size() : static_cast<size_t>(cap - 1);
        std::memcpy(buf, text.data(), n);
        buf[n] = '\0';
    }
    return static_cast<int32_t>(text.size());
}

}  // namespace

extern "C" {

//! One tensor's descriptor: rank, TensorRT DataType and TensorFormat values, dims (for
//! getOutputShapes, a negative dim is an unknown runtime value) and profile bounds.
typedef struct DashHarnessTensor {
    int32_t rank;
    int32_t type;
    int32_t format;
    int32_t reserved;
    int64_t dims[8];
    int64_t min[8];
    int64_t opt[8];
    int64_t max[8];
} DashHarnessTensor;

}  // extern "C"

static_assert(kMaxDims == 8, "DashHarnessTensor holds 8 dims, as nvinfer1::Dims does");

namespace {

bool validTensors(DashHarnessTensor const* t, int32_t n) {
    if (t == nullptr || n < 0 || n > kMaxTensors) return false;
    for (int32_t i = 0; i < n; ++i)
        if (t[i].rank < 0 || t[i].rank > kMaxDims) return false;
    return true;
}

nvinfer1::Dims toDims(int32_t rank, int64_t const* values) {
    nvinfer1::Dims d{};
    d.nbDims = rank;
    for (int32_t i = 0; i < rank; ++i) d.d[i] = values[i];
    return d;
}

nvinfer1::PluginTensorDesc toDesc(DashHarnessTensor const& t) {
    nvinfer1::PluginTensorDesc d{};
    d.dims = toDims(t.rank, t.dims);
    d.type = static_cast<nvinfer1::DataType>(t.type);
    d.format = static_cast<nvinfer1::TensorFormat>(t.format);
    d.scale = -1.0F;
    return d;
}

nvinfer1::DynamicPluginTensorDesc toDynamic(DashHarnessTensor const& t) {
    nvinfer1::DynamicPluginTensorDesc d{};
    d.desc = toDesc(t);
    d.min = toDims(t.rank, t.min);
    d.opt = toDims(t.rank, t.opt);
    d.max = toDims(t.rank, t.max);
    return d;
}

}  // namespace

DASH_HARNESS_API int32_t dash_harness_abi(void) { return kHarnessAbi; }

//! Make `name` (a creator's plugin name) the creator the other calls use; 0 if getCreators()
//! hands one out, -1 (and the DashAttention creator kept) if not.
DASH_HARNESS_API int32_t dash_harness_select_creator(char const* name) {
    if (name == nullptr) return -1;
    std::string const previous = gCreatorName;
    gCreatorName = name;
    if (creator() != nullptr) return 0;
    gCreatorName = previous;
    return -1;
}

//! Everything the plugin logged since the last clear (lines "[E] DashAttention: ...").
DASH_HARNESS_API char const* dash_harness_messages(void) {
    std::lock_guard<std::mutex> lock(gMessageMutex);
    gMessagesCopy = gMessages;
    return gMessagesCopy.c_str();
}

DASH_HARNESS_API void dash_harness_clear_messages(void) {
    std::lock_guard<std::mutex> lock(gMessageMutex);
    gMessages.clear();
}

//! TensorRT DataType value of "float32", "float16", "bfloat16", "int32", "int64", "int8",
//! "uint8", "bool"; -1 for other names.
DASH_HARNESS_API int32_t dash_harness_type_code(char const* name) {
    using nvinfer1::DataType;
    struct Entry {
        char const* name;
        DataType type;
    };
    static Entry const kTypes[] = {{"float32", DataType::kFLOAT}, {"float16", DataType::kHALF},
                                   {"bfloat16", DataType::kBF16},  {"int32", DataType::kINT32},
                                   {"int64", DataType::kINT64},   {"int8", DataType::kINT8},
                                   {"uint8", DataType::kUINT8},   {"bool", DataType::kBOOL}};
    for (Entry const& e : kTypes)
        if (name != nullptr && std::strcmp(name, e.name) == 0) return static_cast<int32_t>(e.type);
    return -1;
}

//! TensorRT PluginFieldType value of "float16", "float32", "float64", "int8", "int16", "int32",
//! "int64", "char", "bf16"; -1 for other names.
DASH_HARNESS_API int32_t dash_harness_field_type_code(char const* name) {
    using nvinfer1::PluginFieldType;
    struct Entry {
        char const* name;
        PluginFieldType type;
    };
    static Entry const kTypes[] = {{"float16", PluginFieldType::kFLOAT16}, {"float32", PluginFieldType::kFLOAT32},
                                   {"float64", PluginFieldType::kFLOAT64}, {"int8", PluginFieldType::kINT8},
                                   {"int16", PluginFieldType::kINT16},     {"int32", PluginFieldType::kINT32},
                                   {"int64", PluginFieldType::kINT64},     {"char", PluginFieldType::kCHAR},
                                   {"bf16", PluginFieldType::kBF16}};
    for (Entry const& e : kTypes)
        if (name != nullptr && std::strcmp(name, e.name) == 0) return static_cast<int32_t>(e.type);
    return -1;
}

//! TensorRT TensorFormat value of "linear", "chw32", "hwc8"; -1 for other names.
DASH_HARNESS_API int32_t dash_harness_format_code(char const* name) {
    using nvinfer1::TensorFormat;
    if (name == nullptr) return -1;
    if (std::strcmp(name, "linear") == 0) return static_cast<int32_t>(TensorFormat::kLINEAR);
    if (std::strcmp(name, "chw32") == 0) return static_cast<int32_t>(TensorFormat::kCHW32);
    if (std::strcmp(name, "hwc8") == 0) return static_cast<int32_t>(TensorFormat::kHWC8);
    return -1;
}

//! The creator as TensorRT sees it: lines "interface=", "name=", "version=", "namespace=", then
//! one "field=<name>:<PluginFieldType>:<length>" per getFieldNames() entry. Returns the length.
DASH_HARNESS_API int32_t dash_harness_creator_info(char* buf, int32_t cap) {
    nvinfer1::IPluginCreatorV3One* c = creator();
    if (c == nullptr) return -1;
    dash::trt::Text os;
    nvinfer1::InterfaceInfo const info = c->getInterfaceInfo();
    os << "interface=" << info.kind << " " << info.major << "." << info.minor << "\n";
    os << "name=" << c->getPluginName() << "\nversion=" << c->getPluginVersion()
       << "\nnamespace=" << c->getPluginNamespace() << "\n";
    nvinfer1::PluginFieldCollection const* fc = c->getFieldNames();
    for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i)
        os << "field=" << fc->fields[i].name << ":" << static_cast<int32_t>(fc->fields[i].type) << ":"
           << fc->fields[i].length << "\n";
    return copyText(os.str(), buf, cap);
}

//! createPlugin from fields (`types` are PluginFieldType values); phase 0 = build, 1 = runtime.
//! Returns a handle, or NULL (the reason is in the messages).
DASH_HARNESS_API void* dash_harness_create(char const* const* names, int32_t const* types, void const* const* data,
                                           int32_t const* lengths, int32_t n, int32_t phase) {
    nvinfer1::IPluginCreatorV3One* c = creator();
    if (c == nullptr || n < 0 || (n > 0 && (names == nullptr || types == nullptr || data == nullptr || lengths == nullptr)))
        return nullptr;
    std::vector<nvinfer1::PluginField> fields;
    for (int32_t i = 0; i < n; ++i)
        fields.emplace_back(names[i], data[i], static_cast<nvinfer1::PluginFieldType>(types[i]), lengths[i]);
    nvinfer1::PluginFieldCollection fc{};
    fc.nbFields = n;
    fc.fields = fields.data();
    nvinfer1::IPluginV3* plugin =
        c->createPlugin("harness", &fc, phase == 0 ? nvinfer1::TensorRTPhase::kBUILD : nvinfer1::TensorRTPhase::kRUNTIME);
    if (plugin == nullptr) return nullptr;
    auto* h = new (std::nothrow) Handle;
    if (h == nullptr) {
        delete plugin;
        return nullptr;
    }
    h->plugin = plugin;
    return h;
}

DASH_HARNESS_API void dash_harness_destroy(void* handle) {
    auto* h = static_cast<Handle*>(handle);
    if (h == nullptr) return;
    delete h->plugin;
    delete h;
}

//! A new handle from an existing one: mode 0 IPluginV3::clone, 1 attachToContext (what an
//! execution context does), 2 getFieldsToSerialize -> createPlugin(kRUNTIME) (what engine
//! deserialisation does). NULL on failure.
DASH_HARNESS_API void* dash_harness_clone(void* handle, int32_t mode) {
    auto* h = static_cast<Handle*>(handle);
    if (h == nullptr) return nullptr;
    nvinfer1::IPluginV3* copy = nullptr;
    if (mode == 0) {
        copy = h->plugin->clone();
    } else if (mode == 1) {
        static HarnessResourceContext context;
        copy = h->runtime()->attachToContext(&context);
    } else if (mode == 2) {
        nvinfer1::PluginFieldCollection const* fc = h->runtime()->getFieldsToSerialize();
        nvinfer1::IPluginCreatorV3One* c = creator();
        if (fc == nullptr || c == nullptr) return nullptr;
        copy = c->createPlugin("harness-deserialized", fc, nvinfer1::TensorRTPhase::kRUNTIME);
    }
    if (copy == nullptr) return nullptr;
    auto* out = new (std::nothrow) Handle;
    if (out == nullptr) {
        delete copy;
        return nullptr;
    }
    out->plugin = copy;
    return out;
}

//! The plugin as TensorRT sees it: lines "name=", "version=", "namespace=", "outputs=",
//! "build_interface=<kind> <major>.<minor>", "metadata=", "timing_cache_id=", and one
//! "serialized=<name>:<type>:<length>:<values>" per getFieldsToSerialize() field.
DASH_HARNESS_API int32_t dash_harness_plugin_info(void* handle, char* buf, int32_t cap) {
    auto* h = static_cast<Handle*>(handle);
    if (h == nullptr) return -1;
    dash::trt::Text os;
    nvinfer1::IPluginV3OneCore* core = h->core();
    os << "name=" << core->getPluginName() << "\nversion=" << core->getPluginVersion()
       << "\nnamespace=" << core->getPluginNamespace() << "\n";
    auto* cap0 = h->plugin->getCapabilityInterface(nvinfer1::PluginCapabilityType::kBUILD);
    if (cap0 != nullptr) {
        auto* build = static_cast<nvinfer1::IPluginV3OneBuild*>(cap0);
        nvinfer1::InterfaceInfo const info = build->getInterfaceInfo();
        os << "build_interface=" << info.kind << " " << info.major << "." << info.minor << "\n";
        os << "outputs=" << build->getNbOutputs() << "\n";
        char const* meta = build->getMetadataString();
        char const* tid = build->getTimingCacheID();
        os << "metadata=" << (meta ? meta : "") << "\ntiming_cache_id=" << (tid ? tid : "") << "\n";
    }
    nvinfer1::PluginFieldCollection const* fc = h->runtime()->getFieldsToSerialize();
    for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i) {
        nvinfer1::PluginField const& f = fc->fields[i];
        os << "serialized=" << f.name << ":" << static_cast<int32_t>(f.type) << ":" << f.length << ":";
        for (int32_t j = 0; j < f.length; ++j) {
            if (f.type == nvinfer1::PluginFieldType::kINT32)
                os << (j ? "," : "") << static_cast<int32_t const*>(f.data)[j];
            else if (f.type == nvinfer1::PluginFieldType::kFLOAT32)
                os << (j ? "," : "") << static_cast<float const*>(f.data)[j];
            else if (f.type == nvinfer1::PluginFieldType::kCHAR && static_cast<char const*>(f.data)[j] != '\0')
                os << static_cast<char const*>(f.data)[j];
        }
        os << "\n";
    }
    return copyText(os.str(), buf, cap);
}

DASH_HARNESS_API int32_t dash_harness_output_types(void* handle, int32_t const* inTypes, int32_t nbInputs,
                                                   int32_t* outTypes, int32_t nbOutputs) {
    auto* h = static_cast<Handle*>(handle);
    if (h == nullptr || inTypes == nullptr || outTypes == nullptr || nbInputs < 0 || nbInputs > kMaxTensors ||
        nbOutputs < 0 || nbOutputs > kMaxTensors)
        return -2;
    nvinfer1::IPluginV3OneBuildV2* b = buildOf(h);
    if (b == nullptr) return -2;
    std::vector<nvinfer1::DataType> in(static_cast<size_t>(nbInputs)), out(static_cast<size_t>(nbOutputs));
    for (int32_t i = 0; i < nbInputs; ++i) in[static_cast<size_t>(i)] = static_cast<nvinfer1::DataType>(inTypes[i]);
    int32_t const status = b->getOutputDataTypes(out.data(), nbOutputs, in.data(), nbInputs);
    for (int32_t o = 0; o < nbOutputs; ++o) outTypes[o] = static_cast<int32_t>(out[static_cast<size_t>(o)]);
    return status;
}

//! getOutputShapes with the stand-in IExprBuilder: negative input dims are unknown runtime
//! values; output dims that are not constants come back as -1.
DASH_HARNESS_API int32_t dash_harness_output_shapes(void* handle, DashHarnessTensor const* in, int32_t nbInputs,
                                                    DashHarnessTensor* out, int32_t nbOutputs) {
    auto* h = static_cast<Handle*>(handle);
    if (h == nullptr || !validTensors(in, nbInputs) || out == nullptr || nbOutputs < 0 || nbOutputs > kMaxTensors)
        return -2;
    nvinfer1::IPluginV3OneBuildV2* b = buildOf(h);
    if (b == nullptr) return -2;
    HarnessExprBuilder builder;
    std::vector<nvinfer1::DimsExprs> inputs(static_cast<size_t>(nbInputs));
    for (int32_t i = 0; i < nbInputs; ++i) {
        inputs[static_cast<size_t>(i)].nbDims = in[i].rank;
        for (int32_t a = 0; a < in[i].rank; ++a) inputs[static_cast<size_t>(i)].d[a] = builder.make(in[i].dims[a]);
    }
    std::vector<nvinfer1::DimsExprs> outputs(static_cast<size_t>(nbOutputs));
    int32_t const status =
        b->getOutputShapes(inputs.data(), nbInputs, nullptr, 0, outputs.data(), nbOutputs, builder);
    if (status != 0) return status;
    for (int32_t o = 0; o < nbOutputs; ++o) {
        nvinfer1::DimsExprs const& e = outputs[static_cast<size_t>(o)];
        out[o].rank = e.nbDims;
        for (int32_t a = 0; a < e.nbDims && a < kMaxDims; ++a)
            out[o].dims[a] = (e.d[a] != nullptr && e.d[a]->isConstant()) ? e.d[a]->getConstantValue() : -1;
    }
    return 0;
}

DASH_HARNESS_API int32_t dash_harness_aliased_input(void* handle, int32_t outputIndex) {
    auto* h = static_cast<Handle*>(handle);
    nvinfer1::IPluginV3OneBuildV2* b = h != nullptr ? buildOf(h) : nullptr;
    if (b == nullptr) return -2;
    return b->getAliasedInput(outputIndex);
}

//! supportsFormatCombination(pos) over nbInputs + nbOutputs descriptors: 1 yes, 0 no.
DASH_HARNESS_API int32_t dash_harness_supports(void* handle, int32_t pos, DashHarnessTensor const* io,
                                               int32_t nbInputs, int32_t nbOutputs) {
    auto* h = static_cast<Handle*>(handle);
    if (h == nullptr || nbInputs < 0 || nbOutputs < 0 || !validTensors(io, nbInputs + nbOutputs)) return -2;
    nvinfer1::IPluginV3OneBuildV2* b = buildOf(h);
    if (b == nullptr) return -2;
    std::vector<nvinfer1::DynamicPluginTensorDesc> d;
    for (int32_t i = 0; i < nbInputs + nbOutputs; ++i) d.push_back(toDynamic(io[i]));
    return b->supportsFormatCombination(pos, d.data(), nbInputs, nbOutputs) ? 1 : 0;
}

DASH_HARNESS_API int32_t dash_harness_configure(void* handle, DashHarnessTensor const* io, int32_t nbInputs,
                                                int32_t nbOutputs) {
    auto* h = static_cast<Handle*>(handle);
    if (h == nullptr || nbInputs < 0 || nbOutputs < 0 || !validTensors(io, nbInputs + nbOutputs)) return -2;
    nvinfer1::IPluginV3OneBuildV2* b = buildOf(h);
    if (b == nullptr) return -2;
    std::vector<nvinfer1::DynamicPluginTensorDesc> d;
    for (int32_t i = 0; i < nbInputs + nbOutputs; ++i) d.push_back(toDynamic(io[i]));
    return b->configurePlugin(d.data(), nbInputs, d.data() + nbInputs, nbOutputs);
}

//! getWorkspaceSize over the descriptors' min/opt/max bounds (as TensorRT calls it after
//! configurePlugin). Returns the bytes, or -2 on a bad call.
DASH_HARNESS_API int64_t dash_harness_workspace_size(void* handle, DashHarnessTensor const* io, int32_t nbInputs,
                                                     int32_t nbOutputs) {
    auto* h = static_cast<Handle*>(handle);
    if (h == nullptr || nbInputs < 0 || nbOutputs < 0 || !validTensors(io, nbInputs + nbOutputs)) return -2;
    nvinfer1::IPluginV3OneBuildV2* b = buildOf(h);
    if (b == nullptr) return -2;
    std::vector<nvinfer1::DynamicPluginTensorDesc> d;
    for (int32_t i = 0; i < nbInputs + nbOutputs; ++i) d.push_back(toDynamic(io[i]));
    return static_cast<int64_t>(b->getWorkspaceSize(d.data(), nbInputs, d.data() + nbInputs, nbOutputs));
}

DASH_HARNESS_API int32_t dash_harness_on_shape_change(void* handle, DashHarnessTensor const* io, int32_t nbInputs,
                                                      int32_t nbOutputs) {
    auto* h = static_cast<Handle*>(handle);
    if (h == nullptr || nbInputs < 0 || nbOutputs < 0 || !validTensors(io, nbInputs + nbOutputs)) return -2;
    std::vector<nvinfer1::PluginTensorDesc> d;
    for (int32_t i = 0; i < nbInputs + nbOutputs; ++i) d.push_back(toDesc(io[i]));
    return h->runtime()->onShapeChange(d.data(), nbInputs, d.data() + nbInputs, nbOutputs);
}

//! enqueue on caller-provided device buffers and a cudaStream_t (0 = the legacy default stream).
DASH_HARNESS_API int32_t dash_harness_enqueue(void* handle, DashHarnessTensor const* io, int32_t nbInputs,
                                              int32_t nbOutputs, void const* const* inputs, void* const* outputs,
                                              void* workspace, void* stream) {
    auto* h = static_cast<Handle*>(handle);
    if (h == nullptr || nbInputs < 0 || nbOutputs < 0 || !validTensors(io, nbInputs + nbOutputs) || inputs == nullptr ||
        outputs == nullptr)
        return -2;
    std::vector<nvinfer1::PluginTensorDesc> d;
    for (int32_t i = 0; i < nbInputs + nbOutputs; ++i) d.push_back(toDesc(io[i]));
    return h->runtime()->enqueue(d.data(), d.data() + nbInputs, inputs, outputs, workspace,
                                 static_cast<cudaStream_t>(stream));
}
