/*
 * DashAttention plugin attributes: parsing, validation and serialization over the one table in
 * dash_attributes.def. No TensorRT runtime calls: only the PluginField types of the headers.
 */
#ifndef DASH_TRT_ATTRIBUTES_H
#define DASH_TRT_ATTRIBUTES_H

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "NvInferRuntime.h"
#include "dash/params.h"

namespace dash {
namespace trt {

enum class AttrKind : int32_t { kInt, kOptInt, kFloat, kPosFloat, kMode, kVersion };

enum class AttrId : int32_t {
#define DASH_ATTR(id, name, kind, required, num, text, minimum, doc) id,
#include "dash_attributes.def"
#undef DASH_ATTR
    kCount
};

constexpr int32_t kNbAttributes = static_cast<int32_t>(AttrId::kCount);

struct AttrSpec {
    char const* name;
    AttrKind kind;
    bool required;
    double defaultNumber;     // kInt, kOptInt, kFloat, kPosFloat
    char const* defaultText;  // kMode, kVersion
    int64_t minimum;          // integer kinds (kOptInt: besides -1)
    char const* doc;
};

//! The table, in dash_attributes.def order.
AttrSpec const& attrSpec(AttrId id) noexcept;
AttrSpec const* attrSpecs() noexcept;

//! Values of every attribute (defaults where not given). Copyable, no pointers into itself.
class DashAttributes {
public:
    DashAttributes();

    //! Parses a creator's field collection (ONNX node attributes or serialized fields). Returns
    //! false with a message naming the attribute on an unknown name, a repeated name, a wrong
    //! field type or length, or a value that validate() refuses.
    bool parse(nvinfer1::PluginFieldCollection const* fc, std::string& error);

    //! Required attributes present, ranges, modes and the version.
    bool validate(std::string& error) const;

    int64_t integer(AttrId id) const noexcept { return mValues[index(id)].ints.empty() ? 0 : mValues[index(id)].ints[0]; }
    std::vector<int64_t> const& ints(AttrId id) const noexcept { return mValues[index(id)].ints; }
    float real(AttrId id) const noexcept { return mValues[index(id)].real; }
    std::string const& text(AttrId id) const noexcept { return mValues[index(id)].text; }
    bool given(AttrId id) const noexcept { return mValues[index(id)].given; }

    //! Writes the configuration fields of DashParams (sizes and pointers are left alone).
    void fillConfig(DashParams& p) const noexcept;

    //! "name=value ..." of every attribute, for getMetadataString and log messages.
    std::string describe() const;

private:
    friend class AttributeFields;
    struct Value {
        bool given{false};
        std::vector<int64_t> ints;
        float real{0.0F};
        std::string text;
    };
    static constexpr size_t index(AttrId id) noexcept { return static_cast<size_t>(id); }
    bool parseField(nvinfer1::PluginField const& field, AttrSpec const& spec, Value& value, std::string& error);

    std::array<Value, kNbAttributes> mValues;
};

//! The serialized form of a DashAttributes (getFieldsToSerialize): owns the buffers the fields
//! point into, so it is rebuilt, never copied, with the plugin object that owns it.
class AttributeFields {
public:
    AttributeFields() = default;
    AttributeFields(AttributeFields const&) = delete;
    AttributeFields& operator=(AttributeFields const&) = delete;

    nvinfer1::PluginFieldCollection const* build(DashAttributes const& attrs);

private:
    std::array<int32_t, kNbAttributes> mInts{};
    std::array<float, kNbAttributes> mReals{};
    std::array<std::string, kNbAttributes> mTexts;
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mCollection{};
};

//! The creator's field list (name, type, length 1; data null), built from the table.
nvinfer1::PluginFieldCollection const* attributeFieldNames() noexcept;

}  // namespace trt
}  // namespace dash

#endif  // DASH_TRT_ATTRIBUTES_H
