// DashAttention attributes: everything is driven by the rows of dash_attributes.def.
#include "dash_attributes.h"

#include <cmath>
#include <cstring>
#include <limits>
#include "dash_text.h"

namespace dash {
namespace trt {

using nvinfer1::PluginField;
using nvinfer1::PluginFieldCollection;
using nvinfer1::PluginFieldType;

namespace {

constexpr AttrSpec kSpecs[] = {
#define DASH_ATTR(id, name, kind, required, num, text, minimum, doc) \
    AttrSpec{name, AttrKind::kind, required, static_cast<double>(num), text, minimum, doc},
#include "dash_attributes.def"
#undef DASH_ATTR
};
static_assert(sizeof(kSpecs) / sizeof(kSpecs[0]) == static_cast<size_t>(kNbAttributes),
              "one AttrSpec per AttrId");

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

bool isIntegerKind(AttrKind k) { return k == AttrKind::kInt || k == AttrKind::kOptInt; }
bool isRealKind(AttrKind k) { return k == AttrKind::kFloat || k == AttrKind::kPosFloat; }
bool isTextKind(AttrKind k) { return k == AttrKind::kMode || k == AttrKind::kVersion; }

PluginFieldType serializedType(AttrKind k) {
    if (isRealKind(k)) return PluginFieldType::kFLOAT32;
    if (isTextKind(k)) return PluginFieldType::kCHAR;
    return PluginFieldType::kINT32;
}

char const* typeName(PluginFieldType t) {
    switch (t) {
        case PluginFieldType::kFLOAT16: return "FLOAT16";
        case PluginFieldType::kFLOAT32: return "FLOAT32";
        case PluginFieldType::kFLOAT64: return "FLOAT64";
        case PluginFieldType::kINT8: return "INT8";
        case PluginFieldType::kINT16: return "INT16";
        case PluginFieldType::kINT32: return "INT32";
        case PluginFieldType::kINT64: return "INT64";
        case PluginFieldType::kCHAR: return "CHAR";
        case PluginFieldType::kDIMS: return "DIMS";
        case PluginFieldType::kBF16: return "BF16";
        default: return "UNKNOWN";
    }
}

// Integers of any integer field type; false for other types.
bool readIntegers(PluginField const& f, std::vector<int64_t>& out) {
    out.clear();
    out.reserve(static_cast<size_t>(f.length));
    for (int32_t i = 0; i < f.length; ++i) {
        switch (f.type) {
            case PluginFieldType::kINT8: out.push_back(static_cast<int8_t const*>(f.data)[i]); break;
            case PluginFieldType::kINT16: out.push_back(static_cast<int16_t const*>(f.data)[i]); break;
            case PluginFieldType::kINT32: out.push_back(static_cast<int32_t const*>(f.data)[i]); break;
            case PluginFieldType::kINT64: out.push_back(static_cast<int64_t const*>(f.data)[i]); break;
            default: return false;
        }
    }
    return f.type == PluginFieldType::kINT8 || f.type == PluginFieldType::kINT16 ||
           f.type == PluginFieldType::kINT32 || f.type == PluginFieldType::kINT64;
}

std::string quoted(std::string const& s) { return "\"" + s + "\""; }

std::string fieldLabel(char const* name) { return std::string("attribute '") + name + "'"; }

}  // namespace

AttrSpec const& attrSpec(AttrId id) noexcept { return kSpecs[static_cast<size_t>(id)]; }
AttrSpec const* attrSpecs() noexcept { return kSpecs; }

DashAttributes::DashAttributes() {
    for (int32_t i = 0; i < kNbAttributes; ++i) {
        AttrSpec const& s = kSpecs[i];
        Value& v = mValues[static_cast<size_t>(i)];
        if (isIntegerKind(s.kind)) v.ints.assign(1, static_cast<int64_t>(s.defaultNumber));
        if (isRealKind(s.kind)) v.real = static_cast<float>(s.defaultNumber);
        if (isTextKind(s.kind)) v.text = s.defaultText;
    }
}

bool DashAttributes::parseField(PluginField const& f, AttrSpec const& s, Value& v, std::string& error) {
    std::string const label = fieldLabel(s.name);
    if (f.length < 0 || (f.length > 0 && f.data == nullptr)) {
        error = label + " has no data (length " + std::to_string(f.length) + ")";
        return false;
    }
    if (isTextKind(s.kind)) {
        if (f.type != PluginFieldType::kCHAR) {
            error = label + " must be a string (CHAR field), got a " + typeName(f.type) + " field";
            return false;
        }
        // The ONNX parser passes the bytes and a terminating NUL; other callers may not.
        char const* text = static_cast<char const*>(f.data);
        size_t n = 0;
        while (n < static_cast<size_t>(f.length) && text[n] != '\0') ++n;
        v.text.assign(text == nullptr ? "" : std::string(text, n));
        return true;
    }
    if (isRealKind(s.kind)) {
        if (f.length != 1) {
            error = label + " must be one number, got " + std::to_string(f.length) + " values";
            return false;
        }
        std::vector<int64_t> asInts;
        if (f.type == PluginFieldType::kFLOAT32) {
            v.real = *static_cast<float const*>(f.data);
        } else if (f.type == PluginFieldType::kFLOAT64) {
            v.real = static_cast<float>(*static_cast<double const*>(f.data));
        } else if (readIntegers(f, asInts)) {
            v.real = static_cast<float>(asInts[0]);
        } else {
            error = label + " must be a number (FLOAT32 field), got a " + typeName(f.type) + " field";
            return false;
        }
        return true;
    }
    std::vector<int64_t> values;
    if (!readIntegers(f, values)) {
        error = label + " must be integer (INT32 or INT64 field), got a " + typeName(f.type) + " field";
        return false;
    }
    if (values.size() != 1) {
        error = label + " must be one integer, got " + std::to_string(values.size()) + " values";
        return false;
    }
    v.ints = std::move(values);
    return true;
}

bool DashAttributes::parse(PluginFieldCollection const* fc, std::string& error) {
    if (fc == nullptr) {
        error = "the field collection is NULL";
        return false;
    }
    if (fc->nbFields > 0 && fc->fields == nullptr) {
        error = "the field collection has " + std::to_string(fc->nbFields) + " fields and no array";
        return false;
    }
    for (int32_t i = 0; i < fc->nbFields; ++i) {
        PluginField const& f = fc->fields[i];
        if (f.name == nullptr) {
            error = "field " + std::to_string(i) + " has no name";
            return false;
        }
        int32_t found = -1;
        for (int32_t a = 0; a < kNbAttributes; ++a)
            if (std::strcmp(f.name, kSpecs[a].name) == 0) found = a;
        if (found < 0) {
            std::string known;
            for (int32_t a = 0; a < kNbAttributes; ++a) known += std::string(a ? ", " : "") + kSpecs[a].name;
            error = std::string("unknown attribute '") + f.name + "'; known attributes are: " + known;
            return false;
        }
        Value& v = mValues[static_cast<size_t>(found)];
        if (v.given) {
            error = fieldLabel(f.name) + " is given twice";
            return false;
        }
        if (!parseField(f, kSpecs[found], v, error)) return false;
        v.given = true;
    }
    return validate(error);
}

bool DashAttributes::validate(std::string& error) const {
    for (int32_t a = 0; a < kNbAttributes; ++a) {
        AttrSpec const& s = kSpecs[a];
        Value const& v = mValues[static_cast<size_t>(a)];
        std::string const label = fieldLabel(s.name);
        if (s.required && !v.given) {
            error = label + " is required";
            return false;
        }
        switch (s.kind) {
            case AttrKind::kInt:
                for (int64_t x : v.ints) {
                    if (x < s.minimum || x > kInt32Max) {
                        error = label + (x < s.minimum ? " must be >= " + std::to_string(s.minimum)
                                                       : std::string(" does not fit in int32")) +
                                ", got " + std::to_string(x);
                        return false;
                    }
                }
                break;
            case AttrKind::kOptInt:
                if (v.ints[0] != -1 && (v.ints[0] < s.minimum || v.ints[0] > kInt32Max)) {
                    error = label + " must be -1 (not set) or in [" + std::to_string(s.minimum) + ", 2^31), got " +
                            std::to_string(v.ints[0]);
                    return false;
                }
                break;
            case AttrKind::kFloat:
            case AttrKind::kPosFloat:
                if (!std::isfinite(v.real)) {
                    error = label + " must be finite, got " + std::to_string(v.real);
                    return false;
                }
                if (s.kind == AttrKind::kPosFloat && !(v.real > 0.0F)) {
                    error = label + " must be > 0, got " + std::to_string(v.real);
                    return false;
                }
                break;
            case AttrKind::kMode:
                if (v.text != "" && v.text != "default" && v.text != "truncate") {
                    error = label + " must be \"\", \"default\" or \"truncate\", got " + quoted(v.text);
                    return false;
                }
                break;
            case AttrKind::kVersion:
                if (v.text != s.defaultText) {
                    error = label + " is " + quoted(v.text) + " but this plugin implements version " +
                            quoted(s.defaultText);
                    return false;
                }
                break;
        }
    }
    return true;
}

void DashAttributes::fillConfig(DashParams& p) const noexcept {
    p.sparse_block_size = static_cast<int32_t>(integer(AttrId::kSparseBlockSize));
    p.sparse_local_block = static_cast<int32_t>(integer(AttrId::kSparseLocalBlock));
    p.topk = static_cast<int32_t>(integer(AttrId::kDashTopkBlocks));
    p.route_scale = real(AttrId::kDashScalingFactor);
    p.prior_floor = real(AttrId::kDashPriorFloor);
    p.sigma = real(AttrId::kDashSigma);
    p.rope_page_pairs = static_cast<int32_t>(integer(AttrId::kSparseRopePagePairs));
    p.rope_tok_theta = real(AttrId::kSparseRopeTokTheta);
    p.rope_page_theta = real(AttrId::kSparseRopePageTheta);
    p.main_truncate = text(AttrId::kSparseMainRopeTokFreqMode) == "truncate" ? 1 : 0;
    p.index_truncate = text(AttrId::kSparseRopeTokFreqMode) == "truncate" ? 1 : 0;
    p.rope_page_mod = static_cast<int32_t>(integer(AttrId::kSparseRopePageMod));
}

std::string DashAttributes::describe() const {
    dash::trt::Text os;
    for (int32_t a = 0; a < kNbAttributes; ++a) {
        AttrSpec const& s = kSpecs[a];
        Value const& v = mValues[static_cast<size_t>(a)];
        os << (a ? " " : "") << s.name << "=";
        if (isTextKind(s.kind)) {
            os << quoted(v.text);
        } else if (isRealKind(s.kind)) {
            os << v.real;
        } else {
            os << v.ints[0];
        }
    }
    return os.str();
}

PluginFieldCollection const* AttributeFields::build(DashAttributes const& attrs) {
    mFields.clear();
    for (int32_t a = 0; a < kNbAttributes; ++a) {
        AttrSpec const& s = kSpecs[a];
        DashAttributes::Value const& v = attrs.mValues[static_cast<size_t>(a)];
        size_t const i = static_cast<size_t>(a);
        if (isTextKind(s.kind)) {
            mTexts[i] = v.text;
            // Same encoding as the ONNX parser: the bytes and a terminating NUL.
            mFields.emplace_back(s.name, mTexts[i].c_str(), PluginFieldType::kCHAR,
                                 static_cast<int32_t>(mTexts[i].size() + 1));
        } else if (isRealKind(s.kind)) {
            mReals[i] = v.real;
            mFields.emplace_back(s.name, &mReals[i], PluginFieldType::kFLOAT32, 1);
        } else {
            mInts[i] = static_cast<int32_t>(v.ints[0]);  // validated to fit in int32
            mFields.emplace_back(s.name, &mInts[i], PluginFieldType::kINT32, 1);
        }
    }
    mCollection.nbFields = static_cast<int32_t>(mFields.size());
    mCollection.fields = mFields.data();
    return &mCollection;
}

PluginFieldCollection const* attributeFieldNames() noexcept {
    struct Names {
        std::array<PluginField, kNbAttributes> fields;
        PluginFieldCollection collection{};
        Names() {
            for (int32_t a = 0; a < kNbAttributes; ++a)
                fields[static_cast<size_t>(a)] = PluginField(kSpecs[a].name, nullptr, serializedType(kSpecs[a].kind), 1);
            collection.nbFields = kNbAttributes;
            collection.fields = fields.data();
        }
    };
    static Names const names;  // built once, on first use (thread-safe static initialisation)
    return &names.collection;
}

}  // namespace trt
}  // namespace dash
