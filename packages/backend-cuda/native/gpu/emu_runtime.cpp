// The device runtime of the SIMT emulator (host memory; runtime.cu, PI_GPU_EMU).
#include "runtime.cu"
