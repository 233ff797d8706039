// Logging through TensorRT's logger when one can be found, stderr otherwise.
#include "dash_logging.h"

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <string>

#if !defined(_WIN32)
#include <dlfcn.h>
#endif

namespace dash {
namespace trt {

namespace {

std::atomic<nvinfer1::ILoggerFinder*> gFinder{nullptr};

#define DASH_STR2(x) #x
#define DASH_STR(x) DASH_STR2(x)

// Only the libraries of the major version we were compiled against: a getLogger of another
// ABI (or of an unrelated library with the same symbol name) must never be called.
char const* const kRuntimeLibraries[] = {
    "libnvinfer.so." DASH_STR(NV_TENSORRT_MAJOR),
    "libnvinfer_lean.so." DASH_STR(NV_TENSORRT_MAJOR),
    "libnvinfer_dispatch.so." DASH_STR(NV_TENSORRT_MAJOR),
};

using GetLoggerFn = nvinfer1::ILogger* (*)();

// Looked up again until found: TensorRT may be loaded after this library.
std::atomic<GetLoggerFn> gGetLogger{nullptr};

nvinfer1::ILogger* globalLogger() noexcept {
    GetLoggerFn fn = gGetLogger.load();
    if (fn == nullptr) {
        fn = reinterpret_cast<GetLoggerFn>(findTensorRTSymbol("getLogger"));
        gGetLogger.store(fn);
    }
    return fn != nullptr ? fn() : nullptr;
}

char const* severityTag(Severity s) {
    switch (s) {
        case Severity::kINTERNAL_ERROR: return "F";
        case Severity::kERROR: return "E";
        case Severity::kWARNING: return "W";
        case Severity::kINFO: return "I";
        case Severity::kVERBOSE: return "V";
    }
    return "?";
}

}  // namespace

void* findTensorRTSymbol(char const* name) noexcept {
#if defined(_WIN32)
    (void)name;
    return nullptr;
#else
    for (char const* lib : kRuntimeLibraries) {
        // RTLD_NOLOAD: a handle only if the process has already loaded it (matched by soname).
        void* handle = dlopen(lib, RTLD_LAZY | RTLD_NOLOAD);
        if (handle == nullptr) continue;
        void* sym = dlsym(handle, name);
        if (sym != nullptr) return sym;  // the handle stays open: the library is in use anyway
        dlclose(handle);
    }
    return nullptr;
#endif
}

int foreignTensorRTMajor() noexcept {
#if defined(_WIN32)
    return 0;
#else
    for (int major = 8; major <= 19; ++major) {
        if (major == NV_TENSORRT_MAJOR) continue;
        for (char const* stem : {"libnvinfer.so.", "libnvinfer_lean.so.", "libnvinfer_dispatch.so."}) {
            std::string const lib = stem + std::to_string(major);
            void* handle = dlopen(lib.c_str(), RTLD_LAZY | RTLD_NOLOAD);
            if (handle == nullptr) continue;
            // The library says which major it is where it can (getInferLibMajorVersion, 10.x on);
            // a library that says ours is ours, whatever its file is called.
            using MajorFn = int32_t (*)();
            auto const fn = reinterpret_cast<MajorFn>(dlsym(handle, "getInferLibMajorVersion"));
            int const found = fn != nullptr ? static_cast<int>(fn()) : major;
            dlclose(handle);
            if (found != NV_TENSORRT_MAJOR) return found;
        }
    }
    return 0;
#endif
}

std::string foreignTensorRTMessage(int major, char const* library) {
    return std::string("[E] DashAttention: ") + library + " was built for TensorRT " +
           std::to_string(NV_TENSORRT_MAJOR) + " (headers " + std::to_string(NV_TENSORRT_MAJOR) + "." +
           std::to_string(NV_TENSORRT_MINOR) + ") and this process runs TensorRT " + std::to_string(major) +
           ": nothing registered. Use the plugin built against TensorRT " + std::to_string(major) +
           " headers (plugins/trt/README.md, 'TensorRT versions').";
}

void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept {
    // Another major's finder has another vtable layout: never call it.
    if (finder == nullptr || foreignTensorRTMajor() != 0) return;
    nvinfer1::ILoggerFinder* expected = nullptr;
    gFinder.compare_exchange_strong(expected, finder);
}

void log(Severity severity, std::string const& message) noexcept {
    try {
        std::string const text = "DashAttention: " + message;
        nvinfer1::ILogger* logger = nullptr;
        if (nvinfer1::ILoggerFinder* finder = gFinder.load()) logger = finder->findLogger();
        if (logger == nullptr) logger = globalLogger();
        if (logger != nullptr) {
            logger->log(severity, text.c_str());
            return;
        }
        if (severity == Severity::kERROR || severity == Severity::kINTERNAL_ERROR || severity == Severity::kWARNING)
            std::fprintf(stderr, "[%s] %s\n", severityTag(severity), text.c_str());
    } catch (...) {
        // Logging must never take the host process down.
    }
}

}  // namespace trt
}  // namespace dash
