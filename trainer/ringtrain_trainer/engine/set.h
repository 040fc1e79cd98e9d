/* One instruction set's kernels. The includer defines SET (the functions' suffix), FMA8 and
 * VLOADN / VSTOREN (the set's fused multiply-add and partial loads and stores) and, for a set
 * wider than eight lanes, the GEMM's VEC, VL, VLOAD, VSTORE, VSPLAT, VFMA, GEMM_MR, GEMM_NV;
 * this compiles every body for them (the 8-lane defaults otherwise) and forgets them all. */
#ifndef VEC
#define VEC v8
#define VL 8
#define VLOAD load8
#define VSTORE store8
#define VSPLAT splat8
#define VFMA FMA8
#define GEMM_MR 6
#define GEMM_NV 2
#endif

#include "kernels.h"
#include "gemm.h"
#include "depthwise.h"

#undef SET
#undef FMA8
#undef VEC
#undef VL
#undef VLOAD
#undef VSTORE
#undef VSPLAT
#undef VFMA
#undef VLOADN
#undef VSTOREN
#undef GEMM_MR
#undef GEMM_NV
