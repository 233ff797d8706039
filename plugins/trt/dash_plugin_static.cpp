// libdash_trt_plugin_static.so: registers the DashAttention creator when the library is loaded,
// for loaders that only dlopen a plugin library and expect it to register itself:
// trtexec --staticPlugins, polygraphy --plugins, ctypes.CDLL.
//
// Why a second library: IPluginRegistry::loadLibrary registers the creators it gets from
// getCreators() and fails if one is already registered, so libdash_trt_plugin.so must not
// register itself on load. This library depends on it (same creators, same code) and adds only
// the load-time registration.
//
// No libnvinfer link here either: getPluginRegistry is looked up in the TensorRT runtime that
// the loading process has already loaded. If none is loaded yet, nothing is registered and the
// message says so (load TensorRT first, e.g. `import tensorrt` before loading this library).
#include <cstdint>
#include <cstdio>

#include "NvInferRuntime.h"
#include "dash_logging.h"

extern "C" nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);

namespace {

using GetPluginRegistryFn = nvinfer1::IPluginRegistry* (*)();

void registerDashCreators() noexcept {
    try {
        if (int const major = dash::trt::foreignTensorRTMajor()) {
            std::fprintf(stderr, "%s\n",
                         dash::trt::foreignTensorRTMessage(major, "libdash_trt_plugin_static.so").c_str());
            return;
        }
        auto const getRegistry =
            reinterpret_cast<GetPluginRegistryFn>(dash::trt::findTensorRTSymbol("getPluginRegistry"));
        nvinfer1::IPluginRegistry* registry = getRegistry != nullptr ? getRegistry() : nullptr;
        if (registry == nullptr) {
            std::fprintf(stderr,
                         "[E] DashAttention: libdash_trt_plugin_static.so was loaded before the TensorRT runtime "
                         "(libnvinfer.so.%d): nothing registered. Load TensorRT first, or load "
                         "libdash_trt_plugin.so with IPluginRegistry::loadLibrary instead.\n",
                         NV_TENSORRT_MAJOR);
            return;
        }
        int32_t n = 0;
        nvinfer1::IPluginCreatorInterface* const* creators = getCreators(n);
        for (int32_t i = 0; i < n; ++i) {
            if (!registry->registerCreator(*creators[i], ""))
                dash::trt::logWarning("a DashAttention creator is already registered; this library was loaded twice "
                                      "or together with libdash_trt_plugin.so through loadLibrary");
        }
    } catch (...) {
        std::fprintf(stderr, "[E] DashAttention: static registration failed\n");
    }
}

struct StaticRegistration {
    StaticRegistration() noexcept { registerDashCreators(); }
};

StaticRegistration const gRegistration;

}  // namespace
