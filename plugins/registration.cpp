/*
 * Entry points TensorRT looks up in a plugin library it loads itself
 * (IPluginRegistry::loadLibrary, trt.get_plugin_registry().load_library,
 * trtexec --dynamicPlugins): getCreators and setLoggerFinder. Nothing here calls into
 * libnvinfer, so libpytrt_kv_plugins.so does not link it.
 */
#include "gatherSelectionKvCachePlugin.h"
#include "pluginCommon.h"
#include "pluginCreators.h"
#include "scatterPaKvCachePlugin.h"

namespace pytrt_kv
{
namespace plugin
{

nvinfer1::IPluginCreatorInterface* const* allCreators(int32_t& nbCreators) noexcept
{
    // Function-local statics: constructed on first use, so the order of static
    // initialisation across translation units never matters.
    static ScatterPaKvCachePluginCreator sScatterCreator;
    static GatherSelectionKvCachePluginCreator sGatherCreator;
    static nvinfer1::IPluginCreatorInterface* const kCREATORS[] = {&sScatterCreator, &sGatherCreator};
    nbCreators = static_cast<int32_t>(sizeof(kCREATORS) / sizeof(kCREATORS[0]));
    return kCREATORS;
}

} // namespace plugin
} // namespace pytrt_kv

extern "C" PYTRT_KV_EXPORT nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
{
    return pytrt_kv::plugin::allCreators(nbCreators);
}

extern "C" PYTRT_KV_EXPORT void setLoggerFinder(nvinfer1::ILoggerFinder* finder)
{
    pytrt_kv::plugin::setLoggerFinder(finder);
}
