// See kernelsEmu.cpp.
#include "../kernels/gatherSelectionKvCache.cu"
