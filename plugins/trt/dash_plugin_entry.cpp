// The plugin library's entry points, as TensorRT's plugin-library convention expects them:
// IPluginRegistry::loadLibrary (trtexec --dynamicPlugins, tensorrt.IPluginRegistry.load_library)
// calls setLoggerFinder and then getCreators. These two are the only symbols the library
// exports (dash_trt_plugin.map).
//
// The deprecated getPluginCreators entry point returns IPluginV2 creators (IPluginCreator); a
// V3 creator cannot be handed out through it, so it is not exported.
#include <cstdint>
#include <cstdio>

#include "NvInferRuntime.h"
#include "dash_logging.h"
#include "dash_plugin.h"

#define DASH_TRT_EXPORT extern "C" __attribute__((visibility("default")))

DASH_TRT_EXPORT void setLoggerFinder(nvinfer1::ILoggerFinder* finder);
DASH_TRT_EXPORT nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);
DASH_TRT_EXPORT int32_t dash_trt_plugin_tensorrt_version();

DASH_TRT_EXPORT void setLoggerFinder(nvinfer1::ILoggerFinder* finder) { dash::trt::setLoggerFinder(finder); }

// The TensorRT version whose headers this library was compiled against, major * 100 + minor
// (1008 for 10.8): read by dash-trt info and dash-build without loading TensorRT.
DASH_TRT_EXPORT int32_t dash_trt_plugin_tensorrt_version() { return NV_TENSORRT_MAJOR * 100 + NV_TENSORRT_MINOR; }

DASH_TRT_EXPORT nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
    // A TensorRT of another major: its registry would call our creators through vtables of
    // another layout. Hand out nothing (TensorRT then reports that the library has no creator).
    if (int const major = dash::trt::foreignTensorRTMajor()) {
        std::fprintf(stderr, "%s\n", dash::trt::foreignTensorRTMessage(major, "libdash_trt_plugin.so").c_str());
        nbCreators = 0;
        return nullptr;
    }
    static dash::trt::DashAttentionCreator sDashAttention;
    static dash::trt::DualChunkAttentionCreator sDualChunkAttention;  // declared; refuses (no kernels yet)
    static nvinfer1::IPluginCreatorInterface* const kCreators[] = {&sDashAttention, &sDualChunkAttention};
    nbCreators = static_cast<int32_t>(sizeof(kCreators) / sizeof(kCreators[0]));
    return kCreators;
}
