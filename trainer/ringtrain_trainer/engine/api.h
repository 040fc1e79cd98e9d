/* The Python functions of _native (argument parsing, buffer checks, the GIL released around
 * each kernel), included once by _native.c after the kernel sets: each checks every buffer's
 * size against the shapes it is given before the kernel reads it, then calls the set ``ks``
 * that this CPU runs. */
#ifndef RINGTRAIN_API_H
#define RINGTRAIN_API_H

/* PyBuffer_Release of every buffer given: each function's buffers, however its checks ended. */
#define RELEASE(...)                                                                           \
    do {                                                                                       \
        Py_buffer *bufs_[] = {__VA_ARGS__};                                                    \
        for (size_t i_ = 0; i_ < sizeof bufs_ / sizeof *bufs_; i_++)                         \
            PyBuffer_Release(bufs_[i_]);                                                       \
    } while (0)

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
        res = Py_NewRef(Py_None);
    } else if (F % 8 != 0 && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "filters must be a multiple of 8");
    RELEASE(&x, &w, &bias, &out, &idx);
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
            res = Py_NewRef(Py_None);
        } else
            PyErr_NoMemory();
    } else if (F % 8 != 0 && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "filters must be a multiple of 8");
    RELEASE(&x, &dout, &idx, &dw, &db);
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
        res = Py_NewRef(Py_None);
    }
    RELEASE(&wt, &dout, &idx, &dx);
    return res;
}

typedef struct {
    const float *g;
    float *w, *m, *v;
    Py_ssize_t n;
    float c1, c2, eps, alpha;
} adam_job;

/* Denormals flushed to zero, inputs and results (MXCSR's DAZ and FTZ bits), as TensorFlow runs
 * every CPU kernel, Keras' Adam included (its ScopedFlushDenormal): a moment whose gradient
 * stays zero decays by beta_1 each step into denormals after ~700 steps, and each denormal took
 * a microcode assist (seen: the seeds' CNN step 2.3 -> 3.9 ms after 650 steps on random labels);
 * it becomes zero instead, as in Keras. Restored after: nothing else in the process changes. */
#define FLUSH_DENORMALS 0x8040u

/* Flush denormals on this thread (on) or not; returns whether they were flushed. */
static int flush(int on) {
#ifdef X86_SETS
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(on ? csr | FLUSH_DENORMALS : csr & ~FLUSH_DENORMALS);
    return (csr & FLUSH_DENORMALS) == FLUSH_DENORMALS;
#else
    (void)on;
    return 0;
#endif
}

static void *adam_run(void *arg) {
    const adam_job *j = arg;
    const int was = flush(1);
    ks->adam_step(j->g, j->w, j->m, j->v, j->n, j->c1, j->c2, j->eps, j->alpha);
    flush(was);
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

/* flush_denormals(on) -> whether they were flushed: FTZ and DAZ on the calling thread. */
static PyObject *flush_denormals(PyObject *self, PyObject *args) {
    int on;
    if (!PyArg_ParseTuple(args, "p", &on))
        return NULL;
    return PyBool_FromLong(flush(on));
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
        res = Py_NewRef(Py_None);
    }
    RELEASE(&g, &w, &m, &v);
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
        res = Py_NewRef(Py_None);
    }
    RELEASE(&a, &row, &red, &b, &out);
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
        res = Py_NewRef(Py_None);
    }
    RELEASE(&a, &w, &out);
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
        res = Py_NewRef(Py_None);
    }
    RELEASE(&conv, &bias, &out, &win);
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
        res = Py_NewRef(Py_None);
    }
    RELEASE(&dout, &win, &dconv);
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
        res = Py_NewRef(Py_None);
    }
    RELEASE(&xp, &k, &z);
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
        res = Py_NewRef(Py_None);
    }
    if (with_dx && dxp.obj) PyBuffer_Release(&dxp);
    RELEASE(&xp, &dz, &k, &dk);
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
        res = Py_NewRef(Py_None);
    }
    RELEASE(&out, &other);
    return res;
}

#endif
