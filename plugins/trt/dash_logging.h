/*
 * Logging for the DashAttention plugin without linking libnvinfer.
 *
 * Messages go to, in order of preference:
 *  1. the logger of the engine or builder that called the plugin, through the ILoggerFinder that
 *     TensorRT hands to setLoggerFinder() when it loads the library (IPluginRegistry::loadLibrary,
 *     trtexec --dynamicPlugins, the Python registry's load_library);
 *  2. TensorRT's global logger (getLogger()), looked up with dlsym in an already loaded
 *     libnvinfer, when the library was loaded some other way (static registration);
 *  3. stderr, for errors and warnings only.
 * Plugin methods never throw and never abort: they log and return a failure status.
 */
#ifndef DASH_TRT_LOGGING_H
#define DASH_TRT_LOGGING_H

#include <string>

#include "NvInferRuntime.h"

namespace dash {
namespace trt {

using Severity = nvinfer1::ILogger::Severity;

//! Stores the finder TensorRT provides (the first non-null one wins, as TensorRT expects).
void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept;

//! Logs `message` (prefixed "DashAttention: ") at `severity`.
void log(Severity severity, std::string const& message) noexcept;

inline void logError(std::string const& message) noexcept { log(Severity::kERROR, message); }
inline void logWarning(std::string const& message) noexcept { log(Severity::kWARNING, message); }
inline void logVerbose(std::string const& message) noexcept { log(Severity::kVERBOSE, message); }

//! A symbol of an already loaded TensorRT runtime library (libnvinfer, lean or dispatch of the
//! major version these headers describe), or nullptr. Never loads a library itself.
void* findTensorRTSymbol(char const* name) noexcept;

//! The major version of a TensorRT runtime the process has loaded that is not the one these
//! headers describe (libnvinfer, lean or dispatch of majors 8 to 19, found by soname, not
//! loaded here), or 0 if there is none. The plugin's vtables, logger and registry calls follow
//! the headers' major: with another major loaded it must register nothing and call nothing
//! (ILoggerFinder gained a versioned base in 11.x, IPluginRegistry lost its V2 methods).
int foreignTensorRTMajor() noexcept;

//! The line to print when foreignTensorRTMajor() is not 0.
std::string foreignTensorRTMessage(int major, char const* library);

}  // namespace trt
}  // namespace dash

#endif  // DASH_TRT_LOGGING_H
