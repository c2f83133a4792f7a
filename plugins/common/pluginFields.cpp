/*
 * The typed plugin-field parser (see pluginFields.h).
 */
#include "pluginFields.h"

#include "pluginCommon.h"

#include <cstring>
#include <limits>

namespace pytrt_kv
{
namespace plugin
{
namespace
{

char const* fieldTypeName(nvinfer1::PluginFieldType type) noexcept
{
    using nvinfer1::PluginFieldType;
    switch (type)
    {
    case PluginFieldType::kFLOAT16: return "kFLOAT16";
    case PluginFieldType::kFLOAT32: return "kFLOAT32";
    case PluginFieldType::kFLOAT64: return "kFLOAT64";
    case PluginFieldType::kINT8: return "kINT8";
    case PluginFieldType::kINT16: return "kINT16";
    case PluginFieldType::kINT32: return "kINT32";
    case PluginFieldType::kCHAR: return "kCHAR";
    case PluginFieldType::kDIMS: return "kDIMS";
    case PluginFieldType::kUNKNOWN: return "kUNKNOWN";
    case PluginFieldType::kINT64: return "kINT64";
    default: return "(other)";
    }
}

std::string choicesText(std::vector<std::string> const& choices)
{
    std::string s;
    for (auto const& c : choices)
    {
        s += (s.empty() ? "\"" : ", \"") + c + "\"";
    }
    return s;
}

int64_t readInt(nvinfer1::PluginField const& f, FieldSpec const& spec)
{
    using nvinfer1::PluginFieldType;
    check(f.type == PluginFieldType::kINT32 || f.type == PluginFieldType::kINT64, "field ", spec.name,
        ": expected type kINT32 or kINT64, got ", fieldTypeName(f.type));
    check(f.length == 1, "field ", spec.name, ": expected one value, got length ", f.length);
    check(f.data != nullptr, "field ", spec.name, ": expected a value, got a null data pointer");
    int64_t v{0};
    if (f.type == PluginFieldType::kINT32)
    {
        int32_t v32{0};
        std::memcpy(&v32, f.data, sizeof(v32)); // the ONNX parser's buffer need not be aligned
        v = v32;
    }
    else
    {
        std::memcpy(&v, f.data, sizeof(v));
    }
    check(v >= spec.minValue && v <= spec.maxValue, "field ", spec.name, ": expected a value in [", spec.minValue, ", ",
        spec.maxValue, "], got ", v);
    return v;
}

std::string readString(nvinfer1::PluginField const& f, FieldSpec const& spec)
{
    check(f.type == nvinfer1::PluginFieldType::kCHAR, "field ", spec.name, ": expected type kCHAR, got ",
        fieldTypeName(f.type));
    check(f.length >= 0, "field ", spec.name, ": expected a length >= 0, got ", f.length);
    check(f.length == 0 || f.data != nullptr, "field ", spec.name, ": expected ", f.length,
        " characters, got a null data pointer");
    // Some producers count the terminating NUL in `length`, some do not: stop at the
    // first NUL within `length` and never read past it.
    auto const* chars = static_cast<char const*>(f.data);
    size_t n = 0;
    while (n < static_cast<size_t>(f.length) && chars[n] != '\0')
    {
        ++n;
    }
    std::string v(chars == nullptr ? "" : std::string(chars, n));
    if (!spec.choices.empty())
    {
        bool ok = false;
        for (auto const& c : spec.choices)
        {
            ok = ok || c == v;
        }
        check(ok, "field ", spec.name, ": expected one of ", choicesText(spec.choices), ", got \"", v, "\"");
    }
    return v;
}

} // namespace

PluginFields::PluginFields(std::vector<FieldSpec> const* specs)
    : mSpecs(specs)
    , mInts(specs->size(), 0)
    , mStrings(specs->size())
{
    for (size_t i = 0; i < specs->size(); ++i)
    {
        FieldSpec const& s = (*specs)[i];
        if (s.kind == FieldKind::kINT)
        {
            mInts[i] = s.intDefault;
        }
        else
        {
            mStrings[i] = s.stringDefault;
        }
    }
}

PluginFields PluginFields::parse(std::vector<FieldSpec> const* specs, nvinfer1::PluginFieldCollection const* fc)
{
    PluginFields out(specs);
    if (fc == nullptr)
    {
        return out;
    }
    check(fc->nbFields >= 0, "fields: expected nbFields >= 0, got ", fc->nbFields);
    check(fc->nbFields == 0 || fc->fields != nullptr, "fields: expected ", fc->nbFields, " fields, got a null pointer");
    std::vector<bool> seen(specs->size(), false);
    for (int32_t k = 0; k < fc->nbFields; ++k)
    {
        nvinfer1::PluginField const& f = fc->fields[k];
        check(f.name != nullptr, "fields: field ", k, " has no name");
        size_t i = 0;
        while (i < specs->size() && std::strcmp((*specs)[i].name, f.name) != 0)
        {
            ++i;
        }
        if (i == specs->size())
        {
            std::string names;
            for (auto const& s : *specs)
            {
                names += (names.empty() ? "" : ", ") + std::string(s.name);
            }
            throw PluginError(concat("field ", f.name, ": unknown field; expected one of ", names));
        }
        check(!seen[i], "field ", f.name, ": given more than once");
        seen[i] = true;
        FieldSpec const& spec = (*specs)[i];
        if (spec.kind == FieldKind::kINT)
        {
            out.mInts[i] = readInt(f, spec);
        }
        else
        {
            out.mStrings[i] = readString(f, spec);
        }
    }
    return out;
}

size_t PluginFields::indexOf(char const* name, FieldKind kind) const
{
    for (size_t i = 0; i < mSpecs->size(); ++i)
    {
        if (std::strcmp((*mSpecs)[i].name, name) == 0 && (*mSpecs)[i].kind == kind)
        {
            return i;
        }
    }
    // A programming error in this library, still reported instead of aborting.
    throw PluginError(concat("internal: no field ", name, " of that kind"));
}

int64_t PluginFields::getInt(char const* name) const
{
    return mInts[indexOf(name, FieldKind::kINT)];
}

std::string const& PluginFields::getString(char const* name) const
{
    return mStrings[indexOf(name, FieldKind::kSTRING)];
}

nvinfer1::PluginFieldCollection const* PluginFields::toCollection()
{
    mIntStorage.assign(mSpecs->size(), 0);
    mFieldStorage.clear();
    for (size_t i = 0; i < mSpecs->size(); ++i)
    {
        FieldSpec const& s = (*mSpecs)[i];
        if (s.kind == FieldKind::kINT)
        {
            // Ranges are checked at parse time, so every value fits in int32 (the type the
            // ONNX parser uses, so both creation paths look alike).
            mIntStorage[i] = static_cast<int32_t>(mInts[i]);
            mFieldStorage.emplace_back(s.name, &mIntStorage[i], nvinfer1::PluginFieldType::kINT32, 1);
        }
        else
        {
            mFieldStorage.emplace_back(s.name, mStrings[i].c_str(), nvinfer1::PluginFieldType::kCHAR,
                static_cast<int32_t>(mStrings[i].size() + 1));
        }
    }
    mCollection.nbFields = static_cast<int32_t>(mFieldStorage.size());
    mCollection.fields = mFieldStorage.data();
    return &mCollection;
}

std::string PluginFields::toString() const
{
    std::string s;
    for (size_t i = 0; i < mSpecs->size(); ++i)
    {
        FieldSpec const& f = (*mSpecs)[i];
        s += (i ? " " : "") + std::string(f.name) + "="
            + (f.kind == FieldKind::kINT ? std::to_string(mInts[i]) : mStrings[i]);
    }
    return s;
}

FieldNames::FieldNames(std::vector<FieldSpec> const* specs)
{
    for (auto const& s : *specs)
    {
        mFields.emplace_back(s.name, nullptr,
            s.kind == FieldKind::kINT ? nvinfer1::PluginFieldType::kINT32 : nvinfer1::PluginFieldType::kCHAR, 1);
    }
    mCollection.nbFields = static_cast<int32_t>(mFields.size());
    mCollection.fields = mFields.data();
}

} // namespace plugin
} // namespace pytrt_kv
