/*
 * Load-time registration, for libpytrt_kv_plugins_autoreg.so (polygraphy --plugins,
 * ctypes.CDLL, trtexec --staticPlugins): the creators register themselves with
 * getPluginRegistry() when the library is loaded.
 *
 * getPluginRegistry() lives in libnvinfer. Instead of linking libnvinfer (which would pin
 * one TensorRT major version and fail to load where the Python wheel ships it under
 * another path), the symbol is found at load time with dlsym:
 *   1. in the global scope (trtexec and C++ applications link libnvinfer);
 *   2. in an already loaded libnvinfer.so.{11,10} or TensorRT-RTX's libtensorrt_rtx.so.1
 *      (the tensorrt / tensorrt_rtx Python modules load them with RTLD_LOCAL, so only
 *      RTLD_NOLOAD by soname finds them);
 *   3. by loading one of them from the default search path (full TensorRT first).
 * When none works the library loads anyway, registers nothing, and says why on stderr
 * (pytrt_kv_registered_creators() then returns -1): a load never aborts a process.
 */
#include "NvInferVersion.h"
#include "pluginCommon.h"
#include "pluginCreators.h"

#include <cstdio>
#include <dlfcn.h>

namespace
{

using GetRegistryFn = nvinfer1::IPluginRegistry* (*) () noexcept;
using GetLoggerFn = nvinfer1::ILogger* (*) () noexcept;

char const* const kNVINFER_SONAMES[]
    = {"libnvinfer.so.11", "libnvinfer.so.10", "libnvinfer.so", "libtensorrt_rtx.so.1", "libtensorrt_rtx.so"};

void* findNvinferSymbol(char const* name) noexcept
{
    if (void* sym = dlsym(RTLD_DEFAULT, name))
    {
        return sym;
    }
    for (int32_t pass = 0; pass < 2; ++pass)
    {
        for (char const* soname : kNVINFER_SONAMES)
        {
            int const flags = pass == 0 ? (RTLD_LAZY | RTLD_NOLOAD) : (RTLD_LAZY | RTLD_LOCAL);
            void* handle = dlopen(soname, flags);
            if (handle == nullptr)
            {
                continue;
            }
            if (void* sym = dlsym(handle, name))
            {
                // The handle stays open: the symbol must outlive this library's use of it.
                return sym;
            }
            dlclose(handle);
        }
    }
    return nullptr;
}

GetLoggerFn gGetLogger{nullptr};
int32_t gRegistered{-1};

nvinfer1::ILogger* nvinferLogger() noexcept
{
    return gGetLogger != nullptr ? gGetLogger() : nullptr;
}

struct AutoRegistrar
{
    AutoRegistrar() noexcept
    {
        auto getRegistry = reinterpret_cast<GetRegistryFn>(findNvinferSymbol("getPluginRegistry"));
        // The layout of the library the registry comes from (two majors may be loaded).
        if (getRegistry != nullptr
            && !pytrt_kv::plugin::abiMatchesHeaders(
                pytrt_kv::plugin::tensorRtAbiOf(reinterpret_cast<void const*>(getRegistry))))
        {
            // Its registry and logger have the other vtable layout: calling them would run
            // unrelated virtuals (a crash, seen with TensorRT-RTX and 10.x headers).
            std::fprintf(stderr,
                "[pytrt_kv] libpytrt_kv_plugins_autoreg.so: built against TensorRT %d headers, but the loaded "
                "TensorRT has the other interface layout; no plugin was registered. Use libpytrt_kv_plugins.so "
                "with IPluginRegistry::loadLibrary, or build against the headers of this TensorRT.\n",
                static_cast<int>(NV_TENSORRT_MAJOR));
            return;
        }
        gGetLogger = reinterpret_cast<GetLoggerFn>(findNvinferSymbol("getLogger"));
        if (gGetLogger != nullptr)
        {
            pytrt_kv::plugin::setFallbackLoggerGetter(&nvinferLogger);
        }
        nvinfer1::IPluginRegistry* registry = getRegistry != nullptr ? getRegistry() : nullptr;
        if (registry == nullptr)
        {
            std::fprintf(stderr,
                "[pytrt_kv] libpytrt_kv_plugins_autoreg.so: getPluginRegistry not found (neither libnvinfer.so.11/.10 "
                "nor libtensorrt_rtx.so.1 is loaded or on the library path); no plugin was registered. Import "
                "tensorrt (or tensorrt_rtx) first, or use "
                "libpytrt_kv_plugins.so with IPluginRegistry::loadLibrary.\n");
            return;
        }
        int32_t n = 0;
        nvinfer1::IPluginCreatorInterface* const* creators = pytrt_kv::plugin::allCreators(n);
        gRegistered = 0;
        for (int32_t i = 0; i < n; ++i)
        {
            if (registry->registerCreator(*creators[i], pytrt_kv::plugin::kPLUGIN_NAMESPACE))
            {
                ++gRegistered;
            }
            else
            {
                pytrt_kv::plugin::logWarning("autoRegister",
                    "a creator was not registered (already registered? never load libpytrt_kv_plugins.so and "
                    "libpytrt_kv_plugins_autoreg.so into one process)");
            }
        }
    }
};

AutoRegistrar gAutoRegistrar;

} // namespace

//! Number of creators registered when the library was loaded; -1 when TensorRT's
//! registry could not be found. Lets Python check that loading registered the plugins.
extern "C" PYTRT_KV_EXPORT int32_t pytrt_kv_registered_creators()
{
    return gRegistered;
}
