// The creator of dash_trt.DualChunkAttention nodes: declared (name, version, the node's attribute
// table) so that TensorRT's ONNX parser finds it and its message, not a missing-importer error.
// There are no Dual Chunk Attention kernels yet: createPlugin checks the node's attributes and
// refuses with a message that says so (dash-build refuses such a file before TensorRT runs).
#include <cstring>
#include <string>
#include <vector>

#include "dash_logging.h"
#include "dash_plugin.h"

namespace dash {
namespace trt {
namespace {

enum class DcaKind { kInt, kFloat };

struct DcaAttribute {
    char const* name;
    DcaKind kind;
};

constexpr DcaAttribute kDcaAttributes[] = {
#define DCA_ATTR(id, onnx_name, kind, doc) {onnx_name, DcaKind::kind},
#include "dca_attributes.def"
#undef DCA_ATTR
};

nvinfer1::PluginFieldCollection const* dcaFieldNames() noexcept {
    static std::vector<nvinfer1::PluginField> const fields = [] {
        std::vector<nvinfer1::PluginField> out;
        for (DcaAttribute const& a : kDcaAttributes)
            out.emplace_back(a.name, nullptr,
                             a.kind == DcaKind::kInt ? nvinfer1::PluginFieldType::kINT32
                                                     : nvinfer1::PluginFieldType::kFLOAT32,
                             1);
        return out;
    }();
    static nvinfer1::PluginFieldCollection const fc{static_cast<int32_t>(fields.size()), fields.data()};
    return &fc;
}

//! What is wrong with the node's fields ("" when each attribute is there once with its type).
std::string checkDcaFields(nvinfer1::PluginFieldCollection const* fc) {
    std::vector<int> seen(sizeof(kDcaAttributes) / sizeof(kDcaAttributes[0]), 0);
    for (int32_t i = 0; fc != nullptr && fc->fields != nullptr && i < fc->nbFields; ++i) {
        nvinfer1::PluginField const& f = fc->fields[i];
        std::string const name = f.name != nullptr ? f.name : "";
        if (name == "plugin_version" || name == "plugin_namespace") continue;  // the ONNX parser's own
        size_t j = 0;
        while (j < seen.size() && name != kDcaAttributes[j].name) ++j;
        if (j == seen.size()) return "unknown attribute '" + name + "'";
        bool const isInt =
            f.type == nvinfer1::PluginFieldType::kINT32 || f.type == nvinfer1::PluginFieldType::kINT64;
        bool const ok = kDcaAttributes[j].kind == DcaKind::kInt ? isInt : f.type == nvinfer1::PluginFieldType::kFLOAT32;
        if (!ok || f.length != 1 || f.data == nullptr)
            return "attribute '" + name + "' must be one " +
                   (kDcaAttributes[j].kind == DcaKind::kInt ? "INT" : "FLOAT");
        ++seen[j];
    }
    for (size_t j = 0; j < seen.size(); ++j)
        if (seen[j] != 1) return std::string("attribute '") + kDcaAttributes[j].name + "' is missing";
    return "";
}

}  // namespace

char const* DualChunkAttentionCreator::getPluginName() const noexcept { return kDcaPluginName; }
char const* DualChunkAttentionCreator::getPluginVersion() const noexcept { return kDcaPluginVersion; }
char const* DualChunkAttentionCreator::getPluginNamespace() const noexcept { return ""; }
nvinfer1::PluginFieldCollection const* DualChunkAttentionCreator::getFieldNames() noexcept {
    return dcaFieldNames();
}

nvinfer1::IPluginV3* DualChunkAttentionCreator::createPlugin(char const* name, nvinfer1::PluginFieldCollection const* fc,
                                                             nvinfer1::TensorRTPhase) noexcept {
    try {
        std::string const layer = name != nullptr ? name : "";
        std::string const problem = checkDcaFields(fc);
        logError("layer '" + layer + "': " + kDcaPluginName + ": " +
                 (problem.empty() ? std::string("") : problem + "; ") +
                 "this plugin has no Dual Chunk Attention kernels yet (only DashAttention): run the model with "
                 "ONNX Runtime or serve it with dash-triton's Python generation model");
    } catch (...) {
        logError("DualChunkAttention: createPlugin: unknown exception");
    }
    return nullptr;
}

}  // namespace trt
}  // namespace dash
