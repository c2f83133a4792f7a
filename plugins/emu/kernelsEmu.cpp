// The kernel sources of plugins/kernels, unchanged, compiled as host C++ for the emulated
// device (docs/EMULATION.md): one translation unit per .cu file keeps their anonymous
// namespaces apart.
#include "../kernels/scatterPaKvCache.cu"
