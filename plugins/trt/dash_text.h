// Message text without iostreams.
//
// A toolchain that links libstdc++ statically into a shared library (the project's H200 image:
// /opt/gcc 13.3) made std::ostream's numeric formatting crash once the library was loaded into
// a Python process that has its own libstdc++ (SIGSEGV in basic_ostream::_M_insert<long>, seen
// in the harness). Text appends with std::to_string / snprintf, which keep no locale state.
// Numbers print as an ostream with default flags would: integers in decimal, reals as "%g".
#pragma once

#include <cstdio>
#include <string>
#include <type_traits>

namespace dash {
namespace trt {

class Text {
public:
    Text& operator<<(std::string const& s) {
        mText += s;
        return *this;
    }
    Text& operator<<(char const* s) {
        mText += s != nullptr ? s : "(null)";
        return *this;
    }
    Text& operator<<(char c) {
        mText += c;
        return *this;
    }
    Text& operator<<(bool b) {
        mText += b ? "1" : "0";
        return *this;
    }
    template <typename T, std::enable_if_t<std::is_integral<T>::value && !std::is_same<T, bool>::value &&
                                               !std::is_same<T, char>::value,
                                           int> = 0>
    Text& operator<<(T v) {
        mText += std::to_string(v);
        return *this;
    }
    template <typename T, std::enable_if_t<std::is_enum<T>::value, int> = 0>
    Text& operator<<(T v) {
        return *this << static_cast<std::underlying_type_t<T>>(v);
    }
    Text& operator<<(double v) {
        char buf[64];
        std::snprintf(buf, sizeof(buf), "%g", v);
        mText += buf;
        return *this;
    }
    std::string const& str() const { return mText; }

private:
    std::string mText;
};

}  // namespace trt
}  // namespace dash
