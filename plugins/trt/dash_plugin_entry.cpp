// The plugin library's entry points, as TensorRT's plugin-library convention expects them:
// IPluginRegistry::loadLibrary (trtexec --dynamicPlugins, tensorrt.IPluginRegistry.load_library)
// calls setLoggerFinder and then getCreators. These two are the only symbols the library
// exports (dash_trt_plugin.map).
//
// The deprecated getPluginCreators entry point returns IPluginV2 creators (IPluginCreator); a
// V3 creator cannot be handed out through it, so it is not exported.
#include <cstdint>

#include "NvInferRuntime.h"
#include "dash_logging.h"
#include "dash_plugin.h"

#define DASH_TRT_EXPORT extern "C" __attribute__((visibility("default")))

DASH_TRT_EXPORT void setLoggerFinder(nvinfer1::ILoggerFinder* finder);
DASH_TRT_EXPORT nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);

DASH_TRT_EXPORT void setLoggerFinder(nvinfer1::ILoggerFinder* finder) { dash::trt::setLoggerFinder(finder); }

DASH_TRT_EXPORT nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
    static dash::trt::DashAttentionCreator sDashAttention;
    static nvinfer1::IPluginCreatorInterface* const kCreators[] = {&sDashAttention};
    nbCreators = static_cast<int32_t>(sizeof(kCreators) / sizeof(kCreators[0]));
    return kCreators;
}
