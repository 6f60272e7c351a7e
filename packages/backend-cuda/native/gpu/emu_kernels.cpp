// The GPU kernels compiled as C++ for the SIMT emulator (port.h, PI_GPU_EMU).
#include "kernels.cu"
