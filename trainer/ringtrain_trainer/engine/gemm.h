/* Narrow float32 matrix products for the engine's layers, compiled once per instruction set like
 * kernels.h (see _native.c). The layers' products are tall and narrow: a conv's im2col rows or a
 * shard's 32 examples times a kernel of at most 64 columns, where OpenBLAS ran at 64-82 GFLOP/s of
 * one core's 160 (profiled on the seeds' models). Here a tile of GEMM_MR rows by GEMM_NV vectors
 * of columns is held in registers (per set: 6 x 64 with AVX-512, 6 x 16 with AVX2), and each
 * element's reduction adds its terms in index order by fused multiply-adds (VFMA): its value
 * does not depend on the tile, the set or the row block a caller asks for, so every set gives
 * the same bits.
 */
#ifndef RINGTRAIN_GEMM_H
#define RINGTRAIN_GEMM_H

/* the reduction block: GEMM_KC rows of a 64-column B are 32 KB */
#define GEMM_KC 128

typedef float v16 __attribute__((vector_size(64)));

#define load16(p)                                                                              \
    ({                                                                                         \
        v16 v_;                                                                                \
        memcpy(&v_, (p), sizeof v_);                                                           \
        v_;                                                                                    \
    })
#define store16(p, v)                                                                          \
    do {                                                                                       \
        const v16 s_ = (v);                                                                    \
        memcpy((p), &s_, sizeof s_);                                                           \
    } while (0)
#define splat16(s)                                                                             \
    ({                                                                                         \
        const float f_ = (s);                                                                  \
        (v16){f_, f_, f_, f_, f_, f_, f_, f_, f_, f_, f_, f_, f_, f_, f_, f_};                  \
    })
/* The first ``n`` lanes from memory (the rest zero), and to memory, where a set has no masked
 * loads: byte copies. */
#define LOADN_BYTES(T, p, n)                                                                  \
    ({                                                                                         \
        T v_ = {0};                                                                            \
        memcpy(&v_, (p), sizeof(float) * (size_t)(n));                                         \
        v_;                                                                                    \
    })
#define STOREN_BYTES(p, v, n)                                                                  \
    do {                                                                                       \
        const __typeof__(v) s_ = (v);                                                          \
        memcpy((p), &s_, sizeof(float) * (size_t)(n));                                         \
    } while (0)

#endif

#ifdef SET

/* One tile: MR rows by NV vectors of columns (or, with ``lanes`` > 0, one vector of which only
 * the first ``lanes`` columns exist), the reduction's terms t0 .. t0 + tc - 1 added to the partial
 * sums in C (or to zero for the first block); A(i, t) = a[row[i] + red[t]]. */
INLINE void NAME(gemm_tile)(const float *a, const int *row, const int *red, const float *B,
                            Py_ssize_t ldb, float *C, Py_ssize_t ldc, Py_ssize_t t0,
                            Py_ssize_t tc, int first, const int MR, const int NV, const int lanes) {
    VEC acc[GEMM_MR][GEMM_NV];
    const float *ar[GEMM_MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++) {
        ar[r] = a + row[r];
#pragma GCC unroll 8
        for (int n = 0; n < NV; n++) {
            acc[r][n] = (VEC){0};
            if (!first && lanes)
                acc[r][n] = VLOADN(C + r * ldc, lanes);
            else if (!first)
                acc[r][n] = VLOAD(C + r * ldc + VL * n);
        }
    }
    for (Py_ssize_t t = t0; t < t0 + tc; t++) {
        VEC b[GEMM_NV];
        const int off = red[t];
#pragma GCC unroll 8
        for (int n = 0; n < NV; n++) {
            b[n] = lanes ? VLOADN(B + t * ldb, lanes) : VLOAD(B + t * ldb + VL * n);
        }
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            const VEC x = VSPLAT(ar[r][off]);
#pragma GCC unroll 8
            for (int n = 0; n < NV; n++) acc[r][n] = VFMA(x, b[n], acc[r][n]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 8
        for (int n = 0; n < NV; n++) {
            if (lanes)
                VSTOREN(C + r * ldc, acc[r][n], lanes);
            else
                VSTORE(C + r * ldc + VL * n, acc[r][n]);
        }
}

INLINE void NAME(gemm_cols)(const float *a, const int *row, const int *red, const float *B,
                            Py_ssize_t ldb, float *C, Py_ssize_t ldc, Py_ssize_t M,
                            Py_ssize_t t0, Py_ssize_t tc, const int NV, const int lanes) {
    Py_ssize_t m = 0;
    for (; m + GEMM_MR <= M; m += GEMM_MR)
        NAME(gemm_tile)(a, row + m, red, B, ldb, C + m * ldc, ldc, t0, tc, t0 == 0, GEMM_MR, NV,
                        lanes);
    for (; m < M; m++)
        NAME(gemm_tile)(a, row + m, red, B, ldb, C + m * ldc, ldc, t0, tc, t0 == 0, 1, NV, lanes);
}

/* Every column block of C for the reduction block t0 .. t0 + tc - 1: GEMM_NV vectors while they
 * fit, then single vectors, then the last columns (N % VL) as a partial vector. */
INLINE void NAME(gemm_blocks)(const float *a, const int *row, const int *red, const float *B,
                              Py_ssize_t ldb, float *C, Py_ssize_t ldc, Py_ssize_t M,
                              Py_ssize_t N, Py_ssize_t t0, Py_ssize_t tc) {
    for (Py_ssize_t c = 0; c < N;) {
        if (N - c >= GEMM_NV * VL) {
            NAME(gemm_cols)(a, row, red, B + c, ldb, C + c, ldc, M, t0, tc, GEMM_NV, 0);
            c += GEMM_NV * VL;
        } else if (N - c >= VL) {
            NAME(gemm_cols)(a, row, red, B + c, ldb, C + c, ldc, M, t0, tc, 1, 0);
            c += VL;
        } else {
            NAME(gemm_cols)(a, row, red, B + c, ldb, C + c, ldc, M, t0, tc, 1, (int)(N - c));
            c = N;
        }
    }
}

/* C (M x N) = A (M x K) @ B (K x N) with A(i, t) = a[row[i] + red[t]]: a plain product
 * (row[i] = i * lda, red[t] = t), its transposed-A twin (row[i] = i, red[t] = t * lda), or a
 * convolution read in place from its input (rows: output pixels, red: kernel taps), so no
 * im2col matrix (9x its input) is written and read back. N up to 64 (or any: column blocks). The
 * reduction runs in blocks of GEMM_KC terms, every tile of C per block, so a block of B
 * (GEMM_KC x N, 32 KB) is read from L1: one tile's pass over all of a Dense's 1.4 MB kernel ran
 * at L2's bandwidth, not the FMA units'. */
static void NAME(gemm)(const float *a, const int *row, const int *red, const float *B, float *C,
                       Py_ssize_t M, Py_ssize_t N, Py_ssize_t K) {
    for (Py_ssize_t t0 = 0; t0 < K; t0 += GEMM_KC) {
        const Py_ssize_t tc = K - t0 < GEMM_KC ? K - t0 : GEMM_KC;
        NAME(gemm_blocks)(a, row, red, B, N, C, N, M, N, t0, tc);
    }
}

/* An 8 x 8 block of a (row stride lda) into o (row stride ldo) transposed, in registers. */
INLINE void NAME(transpose8)(const float *a, Py_ssize_t lda, float *o, Py_ssize_t ldo) {
    const v8i lo = {0, 8, 1, 9, 4, 12, 5, 13}, hi = {2, 10, 3, 11, 6, 14, 7, 15};
    const v8i lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const v8i lo3 = {0, 1, 2, 3, 8, 9, 10, 11}, hi3 = {4, 5, 6, 7, 12, 13, 14, 15};
    v8 r[8], t[8], u[8];
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) r[k] = load8(a + k * lda);
#pragma GCC unroll 4
    for (int k = 0; k < 8; k += 2) {
        t[k] = __builtin_shuffle(r[k], r[k + 1], lo);
        t[k + 1] = __builtin_shuffle(r[k], r[k + 1], hi);
    }
#pragma GCC unroll 2
    for (int k = 0; k < 8; k += 4) {
        u[k] = __builtin_shuffle(t[k], t[k + 2], lo2);
        u[k + 1] = __builtin_shuffle(t[k], t[k + 2], hi2);
        u[k + 2] = __builtin_shuffle(t[k + 1], t[k + 3], lo2);
        u[k + 3] = __builtin_shuffle(t[k + 1], t[k + 3], hi2);
    }
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        store8(o + k * ldo, __builtin_shuffle(u[k], u[k + 4], lo3));
        store8(o + (k + 4) * ldo, __builtin_shuffle(u[k], u[k + 4], hi3));
    }
}

/* C (M x N) = A (M x K) @ W^T with W (N x K): a Dense's input gradient dz @ kernel^T, where
 * OpenBLAS's transposed-operand product ran at 62 GFLOP/s against 82 for the plain one. Each 64
 * columns of C are a product with a 64-row block of W transposed into L1 (8 x 8 in registers),
 * so W is read once; each element adds its K terms in order by fused multiply-adds.
 * K % 8 == 0, K <= GEMM_KC, N % 16 == 0. */
static void NAME(gemm_nt)(const float *A, const float *W, float *C, Py_ssize_t M, Py_ssize_t N,
                          Py_ssize_t K) {
    float bt[GEMM_KC * 64];
    int row[M], red[K];
    for (Py_ssize_t i = 0; i < M; i++) row[i] = (int)(i * K);
    for (Py_ssize_t t = 0; t < K; t++) red[t] = (int)t;
    for (Py_ssize_t c0 = 0; c0 < N; c0 += 64) {
        const Py_ssize_t w = N - c0 < 64 ? N - c0 : 64;
        for (Py_ssize_t j = 0; j < w; j += 8)
            for (Py_ssize_t t = 0; t < K; t += 8)
                NAME(transpose8)(W + (c0 + j) * K + t, K, bt + t * w + j, w);
        NAME(gemm_blocks)(A, row, red, bt, w, C + c0, N, M, w, 0, K);
    }
}

#endif /* SET */
