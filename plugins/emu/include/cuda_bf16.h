// Emulated-device stand-in for the CUDA header of the same name (docs/EMULATION.md).
#pragma once
#include "pytrtKvEmu.h"
