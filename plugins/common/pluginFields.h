/*
 * The typed plugin-field contract, parsed in one place (docs/ARCHITECTURE.md habit 4).
 *
 * A plugin declares its fields once as a FieldSpec table. The same table gives the
 * creator's getFieldNames(), parses createPlugin()'s PluginFieldCollection (build phase:
 * as the ONNX parser passes node attributes, INT as kINT32, STRING as kCHAR; runtime
 * phase: what getFieldsToSerialize() wrote) and serializes the values back.
 */
#pragma once

#include "NvInferRuntime.h"

#include <cstdint>
#include <string>
#include <vector>

namespace pytrt_kv
{
namespace plugin
{

enum class FieldKind : int32_t
{
    kINT = 0,    //!< accepted as kINT32 or kINT64, one element; serialized as kINT32
    kSTRING = 1, //!< kCHAR, `length` bytes, a NUL inside ends the string; serialized as kCHAR
};

//! One field of a creator. Strings are checked against \p choices (when non-empty),
//! ints against [minValue, maxValue]. Every field has a default: ONNX drops attributes
//! that a model does not set.
struct FieldSpec
{
    char const* name;
    FieldKind kind;
    int64_t intDefault;
    char const* stringDefault;
    std::vector<std::string> choices;
    int64_t minValue;
    int64_t maxValue;
};

//! Values of one plugin's fields, parsed and checked. Copyable (clone deep-copies it).
class PluginFields
{
public:
    //! All defaults.
    explicit PluginFields(std::vector<FieldSpec> const* specs);

    //! Parses \p fc (nullptr = no fields). Throws PluginError naming the field for an
    //! unknown or repeated name, a wrong type or length, or a value outside the allowed
    //! set; nothing is partially applied.
    static PluginFields parse(std::vector<FieldSpec> const* specs, nvinfer1::PluginFieldCollection const* fc);

    int64_t getInt(char const* name) const;
    std::string const& getString(char const* name) const;

    //! The values as a collection for getFieldsToSerialize(). Points into this object:
    //! valid until the next call or until this object is destroyed.
    nvinfer1::PluginFieldCollection const* toCollection();

    //! "cache_layout=nd compress_mode= alias_io=1": for metadata and log messages.
    std::string toString() const;

private:
    size_t indexOf(char const* name, FieldKind kind) const;

    std::vector<FieldSpec> const* mSpecs;
    std::vector<int64_t> mInts;
    std::vector<std::string> mStrings;
    // Serialization storage (rebuilt by toCollection, so copies never share pointers).
    std::vector<int32_t> mIntStorage;
    std::vector<nvinfer1::PluginField> mFieldStorage;
    nvinfer1::PluginFieldCollection mCollection{};
};

//! The creator's getFieldNames() answer for \p specs (types as the ONNX parser gives them).
class FieldNames
{
public:
    explicit FieldNames(std::vector<FieldSpec> const* specs);
    nvinfer1::PluginFieldCollection const* collection() const noexcept
    {
        return &mCollection;
    }

private:
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mCollection{};
};

} // namespace plugin
} // namespace pytrt_kv
