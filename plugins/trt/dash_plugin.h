/*
 * DashAttention: the TensorRT IPluginV3 front end of the DASH kernels (dash/dash.h).
 *
 * One plugin layer per dash_trt.DashAttention ONNX node. enqueue fills a DashParams from the
 * tensor descriptors and the node's attributes and calls dash_run, the same launcher the PyTorch
 * binding uses. The six cache outputs are the six cache inputs updated in place: they are
 * declared aliased (IPluginV3OneBuildV2::getAliasedInput), and enqueue also accepts an output
 * bound to a different buffer (it then copies the input cache there first). See README.md.
 *
 * Builds against the TensorRT headers only: nothing here calls into libnvinfer.
 */
#ifndef DASH_TRT_PLUGIN_H
#define DASH_TRT_PLUGIN_H

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "NvInferRuntime.h"
#include "dash/dash.h"
#include "dash_attributes.h"

namespace dash {
namespace trt {

constexpr char const* kPluginName = "DashAttention";
constexpr char const* kPluginVersion = "2";  // = plugin_version's default (dash_attributes.def)

// ------------------------------------------------------------------------- inputs and outputs
// The ONNX node's order. Shapes use T new tokens, H/Hkv query/KV heads, D head dim, Di index dim,
// NB KV blocks of BSZ tokens, PER = BSZ / sparse_block_size, B sequences, W block-table width.
enum Input : int32_t {
    kQ, kK, kV, kIQ, kIK, kCoords, kHeadCls,
    kKeyCache, kValueCache, kIndexCache, kImagePageCache, kSummaryCache, kSummaryPages,
    kBlockTables, kSeqLens, kQueryStartLoc, kPromptLens,
    kNbInputs
};
constexpr int32_t kNbCaches = 6;   // inputs kKeyCache .. kSummaryPages, outputs 1 .. 6
constexpr int32_t kNbOutputs = 1 + kNbCaches;

//! Dimension symbols of the I/O table; kFour/kThree are the constant column counts.
enum Sym : int32_t { kT, kH, kD, kHkv, kDi, kNB, kBSZ, kPER, kB, kW, kBP1, kFour, kThree, kNbSyms };

//! What element types an I/O position takes.
enum class IoType : int32_t {
    kData,     // float32, float16 or bfloat16; every kData tensor has q's type
    kIndex,    // int32 or int64 (converted to int32 in the workspace when int64)
    kInt32,
    kFloat32,
};

struct IoSpec {
    char const* name;
    int32_t rank;
    IoType type;
    Sym dims[4];
};

//! The I/O table (inputs; output 0 is like q, outputs 1..6 like inputs kKeyCache..kSummaryPages).
IoSpec const& inputSpec(int32_t index) noexcept;
char const* outputName(int32_t index) noexcept;

// ------------------------------------------------------------------------------------ plugin
class DashAttentionPlugin : public nvinfer1::IPluginV3,
                            public nvinfer1::IPluginV3OneCore,
                            public nvinfer1::IPluginV3OneBuildV2,
                            public nvinfer1::IPluginV3OneRuntime {
public:
    DashAttentionPlugin(std::string layerName, std::string pluginNamespace, DashAttributes const& attrs);
    DashAttentionPlugin(DashAttentionPlugin const& other);
    DashAttentionPlugin& operator=(DashAttentionPlugin const&) = delete;
    ~DashAttentionPlugin() override = default;

    DashAttributes const& attributes() const noexcept { return mAttrs; }

    // IPluginV3
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
    nvinfer1::IPluginV3* clone() noexcept override;

    // IPluginV3OneCore
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

    // IPluginV3OneBuild(V2)
    int32_t getNbOutputs() const noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
                               nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
                            nvinfer1::DimsExprs const* shapeInputs, int32_t nbShapeInputs,
                            nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                            nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                   int32_t nbOutputs) noexcept override;
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
                            nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                            nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;
    int32_t getAliasedInput(int32_t outputIndex) noexcept override;
    char const* getTimingCacheID() noexcept override;
    char const* getMetadataString() noexcept override;

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
                          nvinfer1::PluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
                    void const* const* inputs, void* const* outputs, void* workspace,
                    cudaStream_t stream) noexcept override;
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

private:
    std::string where() const;  // "layer 'name'" for messages
    int32_t fail(std::string const& method, std::string const& message) const noexcept;
    size_t workspaceFor(nvinfer1::DynamicPluginTensorDesc const* inputs, std::string& error) const;

    std::string mLayerName;
    std::string mNamespace;
    DashAttributes mAttrs;
    std::string mMetadata;
    AttributeFields mSerialized;

    // getWorkspaceSize scans token counts (see workspaceFor); remember the last answer.
    mutable std::mutex mWorkspaceMutex;
    mutable std::string mWorkspaceKey;
    mutable size_t mWorkspaceBytes{0};
    // The workspace TensorRT gives enqueue: the largest getWorkspaceSize answer (profile
    // bounds, also computed by configurePlugin), carried by clones and serialized as the
    // kWorkspaceField field; 0 while unknown. enqueue refuses a call that needs more.
    mutable size_t mWorkspaceBound{0};
    int64_t mSerializedBound{0};
    // enqueue's plan for the shapes it last ran (dash_plan_matches decides whether to re-plan).
    DashPlan mPlan{};
    std::vector<nvinfer1::PluginField> mSerializedFields;
    nvinfer1::PluginFieldCollection mSerializedCollection{};

    friend class DashAttentionCreator;
};

//! The serialized field (not an ONNX attribute) that carries the workspace bytes an engine
//! was built with: INT64, length 1.
constexpr char const* kWorkspaceField = "workspace_bytes";

// ----------------------------------------------------------------------------------- creator
class DashAttentionCreator : public nvinfer1::IPluginCreatorV3One {
public:
    DashAttentionCreator() = default;
    ~DashAttentionCreator() override = default;

    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
    nvinfer1::IPluginV3* createPlugin(char const* name, nvinfer1::PluginFieldCollection const* fc,
                                      nvinfer1::TensorRTPhase phase) noexcept override;

private:
    std::string mNamespace;
};

//! The dash_trt.DualChunkAttention node's creator (dca_creator.cpp): its attribute table
//! (dca_attributes.def) is declared, createPlugin refuses (no kernels yet) with a message.
constexpr char const* kDcaPluginName = "DualChunkAttention";
constexpr char const* kDcaPluginVersion = "1";  // what TensorRT's ONNX parser asks for by default

class DualChunkAttentionCreator : public nvinfer1::IPluginCreatorV3One {
public:
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
    nvinfer1::IPluginV3* createPlugin(char const* name, nvinfer1::PluginFieldCollection const* fc,
                                      nvinfer1::TensorRTPhase phase) noexcept override;
};

}  // namespace trt
}  // namespace dash

#endif  // DASH_TRT_PLUGIN_H
