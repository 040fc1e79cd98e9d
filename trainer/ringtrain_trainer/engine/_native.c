/* ringtrain_trainer.engine._native: the engine's compiled kernels.
 *
 * Why C: numpy cannot fuse, and BLAS is slow on narrow products. The seeds' first layer (Conv2D
 * k x k, one input channel, then a 2x2 max-pool, bias and ReLU) as numpy passes writes the whole
 * conv map (4x the pooled output), reads it back four times to pool, and runs ~14 boolean/float
 * passes to route the pooled gradient back to each window's maximum, all memory-bound; here
 * every pooled output is computed from its window in registers and only the pooled value and the
 * window position that won (one byte) are stored. Besides: a later conv-pool's pooling and input
 * gradient, a narrow GEMM (gemm.h), depthwise convolution (depthwise.h), Adam's step, the
 * divergence check. README, decisions, says what each measured.
 *
 * Instruction sets: kernels.h, gemm.h and depthwise.h hold each kernel's body once; this file
 * compiles them three times (set.h), for AVX-512 (the GEMM and the first conv-pool in 512-bit
 * vectors, the rest in 256-bit ones with 32 registers), AVX2 with FMA, and the x86-64
 * baseline, and picks the widest this CPU has at import (GCC's target_clones picks an `arch=`
 * clone by CPU model, so an unlisted model fell back to the baseline). api.h holds the Python
 * functions.
 *
 * Determinism: built with -ffp-contract=off, so the compiler fuses no multiply-add of its own;
 * where a kernel fuses one it says so (FMA8: vfmadd, or the C library's exact fmaf in the baseline
 * set), each sum runs in one fixed order, and vectorisation is across output channels only, so
 * every set gives the same bits: every replica and worker computes the same values on any x86-64
 * (test_native.py runs each set this CPU has and compares).
 *
 * Every function releases the GIL: the IPU's host threads run their shards in parallel.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>


#include "kernels.h" /* the shared types and helpers, before any set's target */
#include "gemm.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define X86_SETS 1
#include <immintrin.h>
#endif

/* a depthwise convolution's geometry (depthwise.h) */
typedef struct {
    Py_ssize_t B, Hp, Wp, C, M, KH, KW, SH, SW, DH, DW, HO, WO;
} dw_dims;

typedef struct {
    const char *name;
    void (*convpool_fwd)(const float *, const float *, const float *, float *, unsigned char *,
                         Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t);
    void (*convpool_bwd)(const float *, const float *, const unsigned char *, float *, float *,
                         Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t);
    void (*convpool_dx)(const float *, const float *, const unsigned char *, float *, Py_ssize_t,
                        Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t, Py_ssize_t);
    void (*adam_step)(const float *, float *, float *, float *, Py_ssize_t, float, float, float,
                      float);
    void (*gemm)(const float *, const int *, const int *, const float *, float *, Py_ssize_t,
                 Py_ssize_t, Py_ssize_t);
    void (*gemm_nt)(const float *, const float *, float *, Py_ssize_t, Py_ssize_t, Py_ssize_t);
    void (*pool_forward)(const float *, const float *, float *, unsigned char *, Py_ssize_t,
                         Py_ssize_t);
    void (*pool_backward)(const float *, const unsigned char *, float *, Py_ssize_t, Py_ssize_t);
    void (*dw_forward)(const float *, const float *, float *, dw_dims);
    void (*dw_backward)(const float *, const float *, const float *, float *, float *, dw_dims);
    int (*all_finite)(const float *, Py_ssize_t);
    void (*add_scale)(float *, const float *, float, Py_ssize_t);
} kernel_set;

#define CAT(a, b) a##_##b
#define SUFFIX(a, b) CAT(a, b)
#define NAME(f) SUFFIX(f, SET)
/* designated, so a field added to kernel_set can never take its neighbour's function */
#define KERNEL_SET(s)                                                                          \
    static const kernel_set set_##s = {                                                        \
        .name = #s,                                                                            \
        .convpool_fwd = convpool_fwd_##s,                                                      \
        .convpool_bwd = convpool_bwd_into_##s,                                                 \
        .convpool_dx = convpool_dx_##s,                                                        \
        .adam_step = adam_step_##s,                                                            \
        .gemm = gemm_##s,                                                                      \
        .gemm_nt = gemm_nt_##s,                                                                \
        .pool_forward = pool_forward_##s,                                                      \
        .pool_backward = pool_backward_##s,                                                    \
        .dw_forward = dw_forward_##s,                                                          \
        .dw_backward = dw_backward_##s,                                                        \
        .all_finite = all_finite_##s,                                                          \
        .add_scale = add_scale_##s,                                                            \
    }

#ifdef X86_SETS
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma")
#define SET avx512
#define FMA8(a, b, c) ((v8)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(c)))
#define VEC v16
#define VL 16
#define VLOAD load16
#define VSTORE store16
#define VSPLAT splat16
#define VFMA(a, b, c) ((v16)_mm512_fmadd_ps((__m512)(a), (__m512)(b), (__m512)(c)))
#define VLOADN(p, n) ((v16)_mm512_maskz_loadu_ps((__mmask16)((1u << (n)) - 1), (p)))
#define VSTOREN(p, v, n) _mm512_mask_storeu_ps((p), (__mmask16)((1u << (n)) - 1), (__m512)(v))
#define GEMM_MR 6
#define GEMM_NV 4
#include "set.h"
#pragma GCC pop_options
KERNEL_SET(avx512);

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define SET avx2
#define FMA8(a, b, c) ((v8)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(c)))
#define LANE_MASK(n) ((__m256i)((v8i){0, 1, 2, 3, 4, 5, 6, 7} < (n)))
#define VLOADN(p, n) ((v8)_mm256_maskload_ps((p), LANE_MASK(n)))
#define VSTOREN(p, v, n) _mm256_maskstore_ps((p), LANE_MASK(n), (__m256)(v))
#include "set.h"
#pragma GCC pop_options
#undef LANE_MASK
KERNEL_SET(avx2);
#endif

/* a * b + c rounded once, lane by lane, by the C library where the CPU has no FMA: the same
 * bits as the vfmadd of the other sets. */
static inline v8 fma8_lanes(v8 a, v8 b, v8 c) {
    v8 r;
    for (int l = 0; l < 8; l++) r[l] = fmaf(a[l], b[l], c[l]);
    return r;
}

#define SET baseline
#define FMA8 fma8_lanes
#define VLOADN(p, n) LOADN_BYTES(v8, p, n)
#define VSTOREN(p, v, n) STOREN_BYTES(p, v, n)
#include "set.h"
KERNEL_SET(baseline);

static const kernel_set *ks = &set_baseline;

/* At import: the widest set every feature of which this CPU has. */
static void choose_kernels(void) {
#ifdef X86_SETS
    __builtin_cpu_init();
    const int fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (fma && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq"))
        ks = &set_avx512;
    else if (fma)
        ks = &set_avx2;
#endif
}

#include "api.h" /* the Python functions of the kernels */

static PyObject *isa(PyObject *self, PyObject *args) { return PyUnicode_FromString(ks->name); }

/* Tests run every set this CPU has and compare their bits. */
static PyObject *use(PyObject *self, PyObject *args) {
    const char *name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    const kernel_set *sets[] = {
#ifdef X86_SETS
        &set_avx512, &set_avx2,
#endif
        &set_baseline};
    for (size_t i = 0; i < sizeof sets / sizeof *sets; i++)
        if (strcmp(sets[i]->name, name) == 0) {
            const kernel_set *was = ks;
            ks = sets[i];
            return PyUnicode_FromString(was->name);
        }
    PyErr_Format(PyExc_ValueError, "no kernel set %s", name);
    return NULL;
}

static PyMethodDef methods[] = {
    {"convpool_input_grad", convpool_input_grad, METH_VARARGS,
     "convpool_input_grad(kernel_t, dout, idx, dx, B, H, W, C, K, F): the input's gradient, "
     "kernel_t the kernel as (K, K, F, C); C a multiple of 8."},
    {"adam_update", adam_update, METH_VARARGS,
     "adam_update(g, w, m, v, c1, c2, eps, alpha, threads=1): Keras' Adam step in place on "
     "float32 slices (c1 = 1 - beta_1, c2 = 1 - beta_2, alpha the step's bias-corrected rate), "
     "split over up to `threads` threads for a large slice."},
    {"flush_denormals", flush_denormals, METH_VARARGS,
     "flush_denormals(on): denormals flushed to zero (FTZ and DAZ) on the calling thread or "
     "not, as TensorFlow runs its CPU kernels; returns whether they were."},
    {"use", use, METH_VARARGS,
     "use(name): run the kernel set `name` (avx512, avx2, baseline) from now on; returns the "
     "set that ran (for tests: the CPU must have the set's instructions)."},
    {"gemm", gemm, METH_VARARGS,
     "gemm(a, row, red, b, out, N): out (M x N) = A @ b (K x N), A[i, t] = a[row[i] + red[t]] "
     "(row, red: int32 tables of M and K offsets into the float32 buffer a); any N (fastest "
     "up to 64). "
     "Each element sums its K terms in order by fused multiply-adds."},
    {"gemm_nt", gemm_nt, METH_VARARGS,
     "gemm_nt(a, w, out, M, N, K): out (M x N) = a (M x K) @ w.T, w (N x K); N a multiple of "
     "16, K of 8 up to 128. Each element sums its K terms in order by fused multiply-adds."},
    {"pool_relu", pool_relu, METH_VARARGS,
     "pool_relu(conv, bias, out, win, P, F): conv (4, P, F) window-position blocks -> 2x2 "
     "max-pool + bias + ReLU into out (P, F); win: the position that won, 4 where the ReLU "
     "stops the gradient. F a multiple of 8."},
    {"unpool", unpool, METH_VARARGS,
     "unpool(dout, win, dconv, P, F): dconv (4, P, F) = dout at each window's winner, else 0."},
    {"depthwise_forward", depthwise_forward, METH_VARARGS,
     "depthwise_forward(xp, kernel, z, dims): a depthwise conv of the padded input xp (B, Hp, "
     "Wp, C) by kernel (KH, KW, C, M) into z (B, HO, WO, C*M); dims = (B, Hp, Wp, C, M, KH, KW, "
     "SH, SW, DH, DW, HO, WO)."},
    {"depthwise_backward", depthwise_backward, METH_VARARGS,
     "depthwise_backward(xp, dz, kernel, dkernel, dxp, dims): the kernel's gradient and, "
     "unless dxp is None, the padded input's (both overwritten)."},
    {"all_finite", all_finite, METH_VARARGS,
     "all_finite(a): whether no element of the float32 buffer a is inf or NaN."},
    {"add_scale", add_scale, METH_VARARGS,
     "add_scale(out, other, scale): out = (out + other) * scale, float32, in one pass."},
    {"isa", isa, METH_NOARGS, "isa(): the instruction set the kernels' clones run here."},
    {"convpool_forward", convpool_forward, METH_VARARGS,
     "convpool_forward(x, kernel, bias, out, idx, B, H, W, C, K, F): Conv2D KxK valid, 2x2 "
     "max-pool, + bias, ReLU into out (B, hp, wp, F); idx: the window position that won, or 4 "
     "where the ReLU stops the gradient."},
    {"convpool_backward", convpool_backward, METH_VARARGS,
     "convpool_backward(x, dout, idx, dkernel, dbias, B, H, W, C, K, F): the kernel's and "
     "bias's gradients from the pooled gradient (no input gradient: a first layer's)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native", "The engine's compiled kernels (see _native.c).", -1, methods,
    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__native(void) {
    choose_kernels();
    return PyModule_Create(&module);
}
