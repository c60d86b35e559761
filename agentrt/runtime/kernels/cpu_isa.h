// The instruction set of the CPU kernels' integer dot products, chosen at run time (set_cpu_isa,
// defined in cpu_int8_linear.cpp; runtime/hardware.py picks it, $AGENTRT_CPU_ISA forces a lower one):
//   ISA_AVX2: maddubs + madd (AVX2);
//   ISA_AVXVNNI: vpdpbusd, VEX-encoded (AVX-VNNI: Alder Lake, Sapphire Rapids, Zen 5);
//   ISA_AVX512VNNI: vpdpbusd on 256-bit registers (AVX-512 VNNI + VL: Cascade Lake, Zen 4/5).
// With 2 or more batch rows the VNNI paths take up to 4 per pass over a work item's weights, reduce 2
// blocks together, and make the int8 weights unsigned (w + 128, 128 x the block's activation sum
// taken off again: cpu_int8_linear.cpp).
// Each path forms the same exact int32 sum per row and block of 32 (no saturation: |products| are
// bounded by the formats) and does the same float arithmetic after them, in the same order, so every
// path gives the same output bit for bit; the VNNI paths have fewer instructions per block. The VNNI
// functions carry their own target attribute, so the library builds with any compiler that knows the
// instructions, on any CPU; only a CPU that has them is allowed to select them (__builtin_cpu_supports).
#pragma once

#include <atomic>

// small vector helpers called in the kernels' inner loops: inlined even where GCC's unit-growth
// limits would stop it (torch's headers make every unit large; sum8 ran as a call through the PLT)
#ifndef AGENTRT_INLINE
#define AGENTRT_INLINE inline __attribute__((always_inline))
#endif

namespace agentrt_cpu {

enum Isa : int { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVXVNNI = 2, ISA_AVX512VNNI = 3 };

// the active ISA (an atomic read per kernel call)
int cpu_isa();

}  // namespace agentrt_cpu
