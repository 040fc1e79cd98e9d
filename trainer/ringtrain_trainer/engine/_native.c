/* ringtrain_trainer.engine._native: the engine's compiled kernels.
 *
 * Why C: numpy cannot fuse. The seeds' first layer (Conv2D k x k, one input channel, then a 2x2
 * max-pool, bias and ReLU) as numpy passes writes the whole conv map (4x the pooled output), reads
 * it back four times to pool, and runs ~14 boolean/float passes to route the pooled gradient back
 * to each window's maximum, all memory-bound; here every pooled output is computed from its window
 * in registers and only the pooled value and the window position that won (one byte) are stored.
 * Backward reads those bytes and adds each pooled gradient to the kernel's gradient at its winning
 * position only. No input gradient: the kernels serve a first layer (filters a multiple of 8).
 *
 * Instruction sets: kernels.h holds each kernel's body once; this file compiles it three times,
 * for AVX-512 (256-bit vectors with 32 registers: the kernel stays in registers), AVX2 with FMA,
 * and the x86-64 baseline, and picks the widest this CPU has at import (GCC's target_clones picks
 * an `arch=` clone by CPU model, so an unlisted model fell back to the baseline).
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
#pragma GCC pop_options
KERNEL_SET(avx512);

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define SET avx2
#define FMA8(a, b, c) ((v8)_mm256_fmadd_ps((__m256)(a), (__m256)(b), (__m256)(c)))
#define VEC v8
#define VL 8
#define VLOAD load8
#define VSTORE store8
#define VSPLAT splat8
#define VFMA FMA8
#define LANE_MASK(n) ((__m256i)((v8i){0, 1, 2, 3, 4, 5, 6, 7} < (n)))
#define VLOADN(p, n) ((v8)_mm256_maskload_ps((p), LANE_MASK(n)))
#define VSTOREN(p, v, n) _mm256_maskstore_ps((p), LANE_MASK(n), (__m256)(v))
#define GEMM_MR 6
#define GEMM_NV 2
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
#define VEC v8
#define VL 8
#define VLOAD load8
#define VSTORE store8
#define VSPLAT splat8
#define VFMA FMA8
#define VLOADN(p, n) LOADN_BYTES(v8, p, n)
#define VSTOREN(p, v, n) STOREN_BYTES(p, v, n)
#define GEMM_MR 6
#define GEMM_NV 2
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

/* The sums accumulate in this thread's own cache lines, copied out once: the shards' gradient
 * buffers are small numpy arrays that may share a cache line with another shard's, and every
 * pooled position writes them. */
static int convpool_bwd(const float *x, const float *dout, const unsigned char *idx, float *dw,
                        float *db, Py_ssize_t B, Py_ssize_t H, Py_ssize_t W, Py_ssize_t C,
                        Py_ssize_t K, Py_ssize_t F) {
    const size_t nw = (size_t)(K * K * C * F), bytes = sizeof(float) * (nw + (size_t)F);
    float *own = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!own) return 0;
    ks->convpool_bwd(x, dout, idx, own, own + nw, B, H, W, C, K, F);
    memcpy(dw, own, sizeof(float) * nw);
    memcpy(db, own + nw, sizeof(float) * (size_t)F);
    free(own);
    return 1;
}

static int need(Py_buffer *buf, Py_ssize_t n, Py_ssize_t itemsize, const char *name) {
    if (buf->len != n * itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, expected %zd", name, buf->len, n * itemsize);
        return 0;
    }
    return 1;
}

static PyObject *convpool_forward(PyObject *self, PyObject *args) {
    Py_buffer x, w, bias, out, idx;
    Py_ssize_t B, H, W, C, K, F;
    if (!PyArg_ParseTuple(args, "y*y*y*w*w*nnnnnn", &x, &w, &bias, &out, &idx, &B, &H, &W, &C,
                          &K, &F))
        return NULL;
    const Py_ssize_t n = B * ((H - K + 1) / 2) * ((W - K + 1) / 2) * F;
    PyObject *res = NULL;
    if (F % 8 == 0 && need(&x, B * H * W * C, 4, "x") && need(&w, K * K * C * F, 4, "kernel") &&
        need(&bias, F, 4, "bias") && need(&out, n, 4, "out") && need(&idx, n, 1, "idx")) {
        Py_BEGIN_ALLOW_THREADS
        ks->convpool_fwd(x.buf, w.buf, bias.buf, out.buf, idx.buf, B, H, W, C, K, F);
        Py_END_ALLOW_THREADS
        res = Py_None;
        Py_INCREF(res);
    } else if (F % 8 != 0 && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "filters must be a multiple of 8");
    PyBuffer_Release(&x);
    PyBuffer_Release(&w);
    PyBuffer_Release(&bias);
    PyBuffer_Release(&out);
    PyBuffer_Release(&idx);
    return res;
}

static PyObject *convpool_backward(PyObject *self, PyObject *args) {
    Py_buffer x, dout, idx, dw, db;
    Py_ssize_t B, H, W, C, K, F;
    if (!PyArg_ParseTuple(args, "y*y*y*w*w*nnnnnn", &x, &dout, &idx, &dw, &db, &B, &H, &W, &C,
                          &K, &F))
        return NULL;
    const Py_ssize_t n = B * ((H - K + 1) / 2) * ((W - K + 1) / 2) * F;
    PyObject *res = NULL;
    if (F % 8 == 0 && need(&x, B * H * W * C, 4, "x") && need(&dout, n, 4, "dout") &&
        need(&idx, n, 1, "idx") && need(&dw, K * K * C * F, 4, "dkernel") &&
        need(&db, F, 4, "dbias")) {
        int ok;
        Py_BEGIN_ALLOW_THREADS
        ok = convpool_bwd(x.buf, dout.buf, idx.buf, dw.buf, db.buf, B, H, W, C, K, F);
        Py_END_ALLOW_THREADS
        if (ok) {
            res = Py_None;
            Py_INCREF(res);
        } else
            PyErr_NoMemory();
    } else if (F % 8 != 0 && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "filters must be a multiple of 8");
    PyBuffer_Release(&x);
    PyBuffer_Release(&dout);
    PyBuffer_Release(&idx);
    PyBuffer_Release(&dw);
    PyBuffer_Release(&db);
    return res;
}

static PyObject *convpool_input_grad(PyObject *self, PyObject *args) {
    Py_buffer wt, dout, idx, dx;
    Py_ssize_t B, H, W, C, K, F;
    if (!PyArg_ParseTuple(args, "y*y*y*w*nnnnnn", &wt, &dout, &idx, &dx, &B, &H, &W, &C, &K, &F))
        return NULL;
    const Py_ssize_t n = B * ((H - K + 1) / 2) * ((W - K + 1) / 2) * F;
    PyObject *res = NULL;
    if (C % 8 != 0)
        PyErr_SetString(PyExc_ValueError, "input channels must be a multiple of 8");
    else if (need(&wt, K * K * C * F, 4, "kernel_t") && need(&dout, n, 4, "dout") &&
             need(&idx, n, 1, "idx") && need(&dx, B * H * W * C, 4, "dx")) {
        Py_BEGIN_ALLOW_THREADS
        ks->convpool_dx(wt.buf, dout.buf, idx.buf, dx.buf, B, H, W, C, K, F);
        Py_END_ALLOW_THREADS
        res = Py_None;
        Py_INCREF(res);
    }
    PyBuffer_Release(&wt);
    PyBuffer_Release(&dout);
    PyBuffer_Release(&idx);
    PyBuffer_Release(&dx);
    return res;
}

typedef struct {
    const float *g;
    float *w, *m, *v;
    Py_ssize_t n;
    float c1, c2, eps, alpha;
} adam_job;

static void *adam_run(void *arg) {
    const adam_job *j = arg;
    ks->adam_step(j->g, j->w, j->m, j->v, j->n, j->c1, j->c2, j->eps, j->alpha);
    return NULL;
}

/* Elementwise, so splitting the slice across threads changes no bit; the caller's share runs
 * here, the rest on threads that live for this call. */
static void adam_split(adam_job job, int threads) {
    enum { MAXT = 16 };
    pthread_t tid[MAXT];
    adam_job jobs[MAXT];
    int started[MAXT] = {0};
    threads = threads < 1 ? 1 : threads > MAXT ? MAXT : threads;
    const Py_ssize_t per = (job.n + threads - 1) / threads;
    for (int t = threads - 1; t >= 0; t--) {
        const Py_ssize_t lo = t * per, hi = lo + per < job.n ? lo + per : job.n;
        jobs[t] = job;
        jobs[t].g += lo;
        jobs[t].w += lo;
        jobs[t].m += lo;
        jobs[t].v += lo;
        jobs[t].n = hi > lo ? hi - lo : 0;
        if (t > 0) started[t] = pthread_create(&tid[t], NULL, adam_run, &jobs[t]) == 0;
        if (t > 0 && !started[t]) adam_run(&jobs[t]);
    }
    adam_run(&jobs[0]);
    for (int t = 1; t < threads; t++)
        if (started[t]) pthread_join(tid[t], NULL);
}

static PyObject *adam_update(PyObject *self, PyObject *args) {
    Py_buffer g, w, m, v;
    float c1, c2, eps, alpha;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "y*w*w*w*ffff|i", &g, &w, &m, &v, &c1, &c2, &eps, &alpha,
                          &threads))
        return NULL;
    PyObject *res = NULL;
    const Py_ssize_t n = g.len / 4;
    if (need(&w, n, 4, "w") && need(&m, n, 4, "m") && need(&v, n, 4, "v")) {
        const adam_job job = {g.buf, w.buf, m.buf, v.buf, n, c1, c2, eps, alpha};
        if (n < 4096)
            adam_run((void *)&job);
        else {
            /* a thread is worth its start (~20 us) from ~64k weights each */
            const int t = n / threads < 65536 ? (int)(n / 65536) + 1 : threads;
            Py_BEGIN_ALLOW_THREADS
            adam_split(job, t < threads ? t : threads);
            Py_END_ALLOW_THREADS
        }
        res = Py_None;
        Py_INCREF(res);
    }
    PyBuffer_Release(&g);
    PyBuffer_Release(&w);
    PyBuffer_Release(&m);
    PyBuffer_Release(&v);
    return res;
}

/* The extreme of an int32 table (max, or min with ``lowest``). */
static int extreme(const int *t, Py_ssize_t n, int lowest) {
    int e = t[0];
    for (Py_ssize_t i = 1; i < n; i++) e = lowest ? (t[i] < e ? t[i] : e) : (t[i] > e ? t[i] : e);
    return e;
}

static PyObject *gemm(PyObject *self, PyObject *args) {
    Py_buffer a, row, red, b, out;
    Py_ssize_t N;
    if (!PyArg_ParseTuple(args, "y*y*y*y*w*n", &a, &row, &red, &b, &out, &N)) return NULL;
    PyObject *res = NULL;
    const Py_ssize_t M = row.len / 4, K = red.len / 4;
    if (N < 1 || M < 1 || K < 1)
        PyErr_SetString(PyExc_ValueError, "gemm: N and the tables must be non-empty");
    else if (extreme(row.buf, M, 1) < 0 || extreme(red.buf, K, 1) < 0 ||
             (Py_ssize_t)extreme(row.buf, M, 0) + extreme(red.buf, K, 0) >= a.len / 4)
        PyErr_SetString(PyExc_ValueError, "gemm: an offset of the tables is outside a");
    else if (need(&b, K * N, 4, "b") && need(&out, M * N, 4, "out")) {
        Py_BEGIN_ALLOW_THREADS
        ks->gemm(a.buf, row.buf, red.buf, b.buf, out.buf, M, N, K);
        Py_END_ALLOW_THREADS
        res = Py_None;
        Py_INCREF(res);
    }
    PyBuffer_Release(&a);
    PyBuffer_Release(&row);
    PyBuffer_Release(&red);
    PyBuffer_Release(&b);
    PyBuffer_Release(&out);
    return res;
}

static PyObject *gemm_nt(PyObject *self, PyObject *args) {
    Py_buffer a, w, out;
    Py_ssize_t M, N, K;
    if (!PyArg_ParseTuple(args, "y*y*w*nnn", &a, &w, &out, &M, &N, &K)) return NULL;
    PyObject *res = NULL;
    if (M < 1 || N < 16 || N % 16 != 0 || K < 8 || K % 8 != 0 || K > GEMM_KC)
        PyErr_Format(PyExc_ValueError, "gemm_nt: N a multiple of 16, K of 8 up to %d", GEMM_KC);
    else if (need(&a, M * K, 4, "a") && need(&w, N * K, 4, "w") && need(&out, M * N, 4, "out")) {
        Py_BEGIN_ALLOW_THREADS
        ks->gemm_nt(a.buf, w.buf, out.buf, M, N, K);
        Py_END_ALLOW_THREADS
        res = Py_None;
        Py_INCREF(res);
    }
    PyBuffer_Release(&a);
    PyBuffer_Release(&w);
    PyBuffer_Release(&out);
    return res;
}

static PyObject *pool_relu(PyObject *self, PyObject *args) {
    Py_buffer conv, bias, out, win;
    Py_ssize_t P, F;
    if (!PyArg_ParseTuple(args, "y*y*w*w*nn", &conv, &bias, &out, &win, &P, &F)) return NULL;
    PyObject *res = NULL;
    if (F % 8 != 0)
        PyErr_SetString(PyExc_ValueError, "pool_relu: filters must be a multiple of 8");
    else if (need(&conv, 4 * P * F, 4, "conv") && need(&bias, F, 4, "bias") &&
             need(&out, P * F, 4, "out") && need(&win, P * F, 1, "win")) {
        Py_BEGIN_ALLOW_THREADS
        ks->pool_forward(conv.buf, bias.buf, out.buf, win.buf, P, F);
        Py_END_ALLOW_THREADS
        res = Py_None;
        Py_INCREF(res);
    }
    PyBuffer_Release(&conv);
    PyBuffer_Release(&bias);
    PyBuffer_Release(&out);
    PyBuffer_Release(&win);
    return res;
}

static PyObject *unpool(PyObject *self, PyObject *args) {
    Py_buffer dout, win, dconv;
    Py_ssize_t P, F;
    if (!PyArg_ParseTuple(args, "y*y*w*nn", &dout, &win, &dconv, &P, &F)) return NULL;
    PyObject *res = NULL;
    if (F % 8 != 0)
        PyErr_SetString(PyExc_ValueError, "unpool: filters must be a multiple of 8");
    else if (need(&dout, P * F, 4, "dout") && need(&win, P * F, 1, "win") &&
             need(&dconv, 4 * P * F, 4, "dconv")) {
        Py_BEGIN_ALLOW_THREADS
        ks->pool_backward(dout.buf, win.buf, dconv.buf, P, F);
        Py_END_ALLOW_THREADS
        res = Py_None;
        Py_INCREF(res);
    }
    PyBuffer_Release(&dout);
    PyBuffer_Release(&win);
    PyBuffer_Release(&dconv);
    return res;
}

/* dims: B, Hp, Wp, C, M, KH, KW, SH, SW, DH, DW, HO, WO */
static int parse_dw(PyObject *dims, dw_dims *d) {
    return PyArg_ParseTuple(dims, "nnnnnnnnnnnnn", &d->B, &d->Hp, &d->Wp, &d->C, &d->M, &d->KH,
                            &d->KW, &d->SH, &d->SW, &d->DH, &d->DW, &d->HO, &d->WO) &&
           (d->HO - 1) * d->SH + (d->KH - 1) * d->DH < d->Hp &&
           (d->WO - 1) * d->SW + (d->KW - 1) * d->DW < d->Wp && d->C * d->M <= 4096;
}

static PyObject *depthwise_forward(PyObject *self, PyObject *args) {
    Py_buffer xp, k, z;
    PyObject *dims;
    dw_dims d;
    if (!PyArg_ParseTuple(args, "y*y*w*O!", &xp, &k, &z, &PyTuple_Type, &dims)) return NULL;
    PyObject *res = NULL;
    if (!parse_dw(dims, &d)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "depthwise: bad geometry");
    } else if (need(&xp, d.B * d.Hp * d.Wp * d.C, 4, "xp") &&
               need(&k, d.KH * d.KW * d.C * d.M, 4, "kernel") &&
               need(&z, d.B * d.HO * d.WO * d.C * d.M, 4, "z")) {
        Py_BEGIN_ALLOW_THREADS
        ks->dw_forward(xp.buf, k.buf, z.buf, d);
        Py_END_ALLOW_THREADS
        res = Py_None;
        Py_INCREF(res);
    }
    PyBuffer_Release(&xp);
    PyBuffer_Release(&k);
    PyBuffer_Release(&z);
    return res;
}

static PyObject *depthwise_backward(PyObject *self, PyObject *args) {
    Py_buffer xp, dz, k, dk, dxp = {0};
    PyObject *dims, *dxo;
    dw_dims d;
    if (!PyArg_ParseTuple(args, "y*y*y*w*OO!", &xp, &dz, &k, &dk, &dxo, &PyTuple_Type, &dims))
        return NULL;
    PyObject *res = NULL;
    const int with_dx = dxo != Py_None;
    if (with_dx && PyObject_GetBuffer(dxo, &dxp, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        /* error set */
    } else if (!parse_dw(dims, &d)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "depthwise: bad geometry");
    } else if (need(&xp, d.B * d.Hp * d.Wp * d.C, 4, "xp") &&
               need(&dz, d.B * d.HO * d.WO * d.C * d.M, 4, "dz") &&
               need(&k, d.KH * d.KW * d.C * d.M, 4, "kernel") &&
               need(&dk, d.KH * d.KW * d.C * d.M, 4, "dkernel") &&
               (!with_dx || need(&dxp, d.B * d.Hp * d.Wp * d.C, 4, "dxp"))) {
        Py_BEGIN_ALLOW_THREADS
        ks->dw_backward(xp.buf, dz.buf, k.buf, dk.buf, with_dx ? dxp.buf : NULL, d);
        Py_END_ALLOW_THREADS
        res = Py_None;
        Py_INCREF(res);
    }
    if (with_dx && dxp.obj) PyBuffer_Release(&dxp);
    PyBuffer_Release(&xp);
    PyBuffer_Release(&dz);
    PyBuffer_Release(&k);
    PyBuffer_Release(&dk);
    return res;
}

static PyObject *all_finite(PyObject *self, PyObject *args) {
    Py_buffer a;
    if (!PyArg_ParseTuple(args, "y*", &a)) return NULL;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = ks->all_finite(a.buf, a.len / 4);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&a);
    return PyBool_FromLong(ok);
}

static PyObject *add_scale(PyObject *self, PyObject *args) {
    Py_buffer out, other;
    float scale;
    if (!PyArg_ParseTuple(args, "w*y*f", &out, &other, &scale)) return NULL;
    PyObject *res = NULL;
    if (need(&other, out.len / 4, 4, "other")) {
        Py_BEGIN_ALLOW_THREADS
        ks->add_scale(out.buf, other.buf, scale, out.len / 4);
        Py_END_ALLOW_THREADS
        res = Py_None;
        Py_INCREF(res);
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&other);
    return res;
}

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
