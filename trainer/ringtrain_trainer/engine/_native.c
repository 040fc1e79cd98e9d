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
 * Determinism: built with -ffp-contract=off (no fused multiply-add), each sum runs in one fixed
 * order, and vectorisation is across output channels only, so the AVX2 and the baseline clones
 * give the same bits: every replica and worker computes the same values on any x86-64.
 *
 * Every function releases the GIL: the IPU's host threads run their shards in parallel.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx2", "default")))
#else
#define CLONES
#endif

/* Eight output channels: one AVX2 register (two SSE registers in the baseline clone). */
typedef float v8 __attribute__((vector_size(32)));
typedef int v8i __attribute__((vector_size(32)));

static inline v8 load8(const float *p) {
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

/* m ? a : b lane by lane (m: all ones or all zeros per lane), for C's lack of a vector ?: */
static inline v8i pick(v8i m, v8i a, v8i b) { return (a & m) | (b & ~m); }
static inline v8 pickf(v8i m, v8 a, v8 b) { return (v8)pick(m, (v8i)a, (v8i)b); }

/* The window position that won (0..3: row-major in the 2x2 window) or NONE where the ReLU
 * stopped the gradient. */
#define NONE 4

/* Forward, F % 8 == 0: for each pooled output and each block of eight channels, the four window
 * positions' sums run side by side over the taps (the kernel row is loaded once for all four);
 * the max, its position, the bias and the ReLU are vector operations too. */
static inline __attribute__((always_inline)) void
convpool_fwd_body(const float *x, const float *w, const float *bias, float *out, unsigned char *idx,
                  Py_ssize_t B, Py_ssize_t H, Py_ssize_t W, Py_ssize_t C, Py_ssize_t K,
                  Py_ssize_t F) {
    const Py_ssize_t hp = (H - K + 1) / 2, wp = (W - K + 1) / 2, row = W * C;
    const v8 zero = {0};
    const v8i none = {NONE, NONE, NONE, NONE, NONE, NONE, NONE, NONE};
    for (Py_ssize_t b = 0; b < B; b++)
        for (Py_ssize_t i = 0; i < hp; i++)
            for (Py_ssize_t j = 0; j < wp; j++) {
                const Py_ssize_t o = ((b * hp + i) * wp + j) * F;
                const float *x0 = x + ((b * H + 2 * i) * W + 2 * j) * C;
                for (Py_ssize_t f0 = 0; f0 < F; f0 += 8) {
                    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
                    for (Py_ssize_t ki = 0; ki < K; ki++)
                        for (Py_ssize_t kj = 0; kj < K; kj++) {
                            const float *xp = x0 + ki * row + kj * C;
                            const float *wq = w + (ki * K + kj) * C * F + f0;
                            for (Py_ssize_t c = 0; c < C; c++, wq += F) {
                                const v8 wv = load8(wq);
                                a0 += xp[c] * wv;
                                a1 += xp[c + C] * wv;
                                a2 += xp[c + row] * wv;
                                a3 += xp[c + row + C] * wv;
                            }
                        }
                    /* the first maximum wins a tie: a later position only if strictly greater */
                    v8 best = a0;
                    v8i arg = {0}, m = a1 > best;
                    best = pickf(m, a1, best);
                    arg = pick(m, (v8i){1, 1, 1, 1, 1, 1, 1, 1}, arg);
                    m = a2 > best;
                    best = pickf(m, a2, best);
                    arg = pick(m, (v8i){2, 2, 2, 2, 2, 2, 2, 2}, arg);
                    m = a3 > best;
                    best = pickf(m, a3, best);
                    arg = pick(m, (v8i){3, 3, 3, 3, 3, 3, 3, 3}, arg);
                    /* NaN propagates as numpy's maximum does (an overflow must reach the
                     * non-finite check, not vanish in the max or the ReLU) */
                    const v8i nan = (a0 != a0) | (a1 != a1) | (a2 != a2) | (a3 != a3);
                    best = pickf(nan, a0 + a1 + a2 + a3, best);
                    const v8 v = best + load8(bias + f0);
                    const v8i pass = v > zero;
                    store8(out + o + f0, pickf(pass | nan, v, zero));
                    const v8i won = pick(pass, arg, none);
                    for (int f = 0; f < 8; f++) idx[o + f0 + f] = (unsigned char)won[f];
                }
            }
}

CLONES static void convpool_fwd(const float *x, const float *w, const float *bias, float *out,
                                unsigned char *idx, Py_ssize_t B, Py_ssize_t H, Py_ssize_t W,
                                Py_ssize_t C, Py_ssize_t K, Py_ssize_t F) {
    if (K == 3 && C == 1) /* the seeds' first layer: every tap loop unrolled */
        convpool_fwd_body(x, w, bias, out, idx, B, H, W, 1, 3, F);
    else
        convpool_fwd_body(x, w, bias, out, idx, B, H, W, C, K, F);
}

/* Backward, F % 8 == 0: the pooled gradient goes to the winning position of each window only. */
CLONES static void convpool_bwd_into(const float *x, const float *dout, const unsigned char *idx,
                                float *dw, float *db,
                                Py_ssize_t B, Py_ssize_t H, Py_ssize_t W, Py_ssize_t C,
                                Py_ssize_t K, Py_ssize_t F) {
    const Py_ssize_t hp = (H - K + 1) / 2, wp = (W - K + 1) / 2, row = W * C;
    const Py_ssize_t off[4] = {0, C, row, row + C};
    memset(dw, 0, sizeof(float) * K * K * C * F);
    memset(db, 0, sizeof(float) * F);
    for (Py_ssize_t b = 0; b < B; b++)
        for (Py_ssize_t i = 0; i < hp; i++)
            for (Py_ssize_t j = 0; j < wp; j++) {
                const Py_ssize_t o = ((b * hp + i) * wp + j) * F;
                const Py_ssize_t p0 = ((b * H + 2 * i) * W + 2 * j) * C;
                for (Py_ssize_t f0 = 0; f0 < F; f0 += 8) {
                    v8i q8;
                    for (int f = 0; f < 8; f++) q8[f] = idx[o + f0 + f];
                    const v8i d8 = (v8i)load8(dout + o + f0);
                    if (!(q8[0] < NONE || q8[1] < NONE || q8[2] < NONE || q8[3] < NONE ||
                          q8[4] < NONE || q8[5] < NONE || q8[6] < NONE || q8[7] < NONE))
                        continue;
                    const v8 g[4] = {(v8)(d8 & (q8 == 0)), (v8)(d8 & (q8 == 1)),
                                     (v8)(d8 & (q8 == 2)), (v8)(d8 & (q8 == 3))};
                    store8(db + f0, load8(db + f0) + (v8)(d8 & (q8 != NONE)));
                    for (Py_ssize_t ki = 0; ki < K; ki++)
                        for (Py_ssize_t kj = 0; kj < K; kj++) {
                            const Py_ssize_t px = p0 + ki * row + kj * C;
                            float *dwp = dw + (ki * K + kj) * C * F + f0;
                            for (Py_ssize_t c = 0; c < C; c++, dwp += F) {
                                const float *xp = x + px + c;
                                const v8 s = (xp[off[0]] * g[0] + xp[off[1]] * g[1]) +
                                             (xp[off[2]] * g[2] + xp[off[3]] * g[3]);
                                store8(dwp, load8(dwp) + s);
                            }
                        }
                }
            }
}

/* Keras' Adam step on a slice, one pass instead of numpy's eleven, the same float32 operations
 * in the same order on each element (optim/adam.py), so the same bits:
 *   m += (g - m) * c1;  v += (g*g - v) * c2;  w -= alpha * m / (sqrt(v) + eps) */
CLONES static void adam_step(const float *g, float *w, float *m, float *v, Py_ssize_t n, float c1,
                             float c2, float eps, float alpha) {
    for (Py_ssize_t i = 0; i < n; i++) {
        const float gi = g[i];
        const float mi = m[i] + (gi - m[i]) * c1;
        const float vi = v[i] + (gi * gi - v[i]) * c2;
        m[i] = mi;
        v[i] = vi;
        w[i] = w[i] - (mi * alpha) / (sqrtf(vi) + eps);
    }
}

/* The input gradient, C % 8 == 0: each channel's pooled gradient flows back through the kernel
 * from its window's winning position only, ``dx[winner + tap, :] += g[f] * kernel[tap, :, f]``
 * (the kernel given transposed, (K, K, F, C), so that row is contiguous). */
CLONES static void convpool_dx(const float *wt, const float *dout, const unsigned char *idx,
                               float *dx, Py_ssize_t B, Py_ssize_t H, Py_ssize_t W, Py_ssize_t C,
                               Py_ssize_t K, Py_ssize_t F) {
    const Py_ssize_t hp = (H - K + 1) / 2, wp = (W - K + 1) / 2, row = W * C;
    const Py_ssize_t off[4] = {0, C, row, row + C};
    memset(dx, 0, sizeof(float) * B * H * W * C);
    for (Py_ssize_t b = 0; b < B; b++)
        for (Py_ssize_t i = 0; i < hp; i++)
            for (Py_ssize_t j = 0; j < wp; j++) {
                const Py_ssize_t o = ((b * hp + i) * wp + j) * F;
                float *d0 = dx + ((b * H + 2 * i) * W + 2 * j) * C;
                for (Py_ssize_t f = 0; f < F; f++) {
                    const unsigned char q = idx[o + f];
                    if (q == NONE) continue;
                    const float g = dout[o + f];
                    for (Py_ssize_t ki = 0; ki < K; ki++)
                        for (Py_ssize_t kj = 0; kj < K; kj++) {
                            float *dp = d0 + off[q] + ki * row + kj * C;
                            const float *wp_ = wt + ((ki * K + kj) * F + f) * C;
                            for (Py_ssize_t c = 0; c < C; c += 8)
                                store8(dp + c, load8(dp + c) + g * load8(wp_ + c));
                        }
                }
            }
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
    convpool_bwd_into(x, dout, idx, own, own + nw, B, H, W, C, K, F);
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
        convpool_fwd(x.buf, w.buf, bias.buf, out.buf, idx.buf, B, H, W, C, K, F);
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
        convpool_dx(wt.buf, dout.buf, idx.buf, dx.buf, B, H, W, C, K, F);
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
    adam_step(j->g, j->w, j->m, j->v, j->n, j->c1, j->c2, j->eps, j->alpha);
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

static PyObject *isa(PyObject *self, PyObject *args) {
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) return PyUnicode_FromString("avx2");
#endif
    return PyUnicode_FromString("baseline");
}

static PyMethodDef methods[] = {
    {"convpool_input_grad", convpool_input_grad, METH_VARARGS,
     "convpool_input_grad(kernel_t, dout, idx, dx, B, H, W, C, K, F): the input's gradient, "
     "kernel_t the kernel as (K, K, F, C); C a multiple of 8."},
    {"adam_update", adam_update, METH_VARARGS,
     "adam_update(g, w, m, v, c1, c2, eps, alpha, threads=1): Keras' Adam step in place on "
     "float32 slices (c1 = 1 - beta_1, c2 = 1 - beta_2, alpha the step's bias-corrected rate), "
     "split over up to `threads` threads for a large slice."},
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

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
