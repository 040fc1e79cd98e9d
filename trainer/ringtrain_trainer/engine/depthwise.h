/* Depthwise 2-D convolution (DepthwiseConv1D/2D, SeparableConv's first half), channels last,
 * compiled once per instruction set like kernels.h (see _native.c). Each channel has its own
 * tiny filter, so there is no product for BLAS: numpy ran it as a multiply-add pass over the
 * whole batch per tap (kh * kw passes, each output written and re-read per tap); here every
 * output is summed over its taps in registers and written once. The padded input ``xp`` is
 * (B, Hp, Wp, C); the kernel (KH, KW, C, M), output channel c * M + j; outputs (B, HO, WO, C*M).
 * Every sum runs in one fixed order (taps row-major; the batch for the kernel gradient): the
 * same bits on every set. */
#ifdef SET

/* Output channel c * M + j's sum over the taps at output position (b, oy, ox). */
INLINE float NAME(dw_tap_sum)(const float *xp, const float *k, dw_dims d, Py_ssize_t b,
                              Py_ssize_t oy, Py_ssize_t ox, Py_ssize_t c, Py_ssize_t j) {
    float a = 0.0f;
    for (Py_ssize_t ky = 0; ky < d.KH; ky++)
        for (Py_ssize_t kx = 0; kx < d.KW; kx++)
            a += xp[((b * d.Hp + oy * d.SH + ky * d.DH) * d.Wp + ox * d.SW + kx * d.DW) * d.C + c] *
                 k[(ky * d.KW + kx) * d.C * d.M + c * d.M + j];
    return a;
}

static void NAME(dw_forward)(const float *xp, const float *k, float *z, dw_dims d) {
    const Py_ssize_t CM = d.C * d.M;
    const int vec = d.M == 1 && d.C % 8 == 0;
    for (Py_ssize_t b = 0; b < d.B; b++)
        for (Py_ssize_t oy = 0; oy < d.HO; oy++)
            for (Py_ssize_t ox = 0; ox < d.WO; ox++) {
                float *zo = z + ((b * d.HO + oy) * d.WO + ox) * CM;
                if (!vec) {
                    for (Py_ssize_t c = 0; c < d.C; c++)
                        for (Py_ssize_t j = 0; j < d.M; j++)
                            zo[c * d.M + j] = NAME(dw_tap_sum)(xp, k, d, b, oy, ox, c, j);
                    continue;
                }
                const float *x0 = xp + ((b * d.Hp + oy * d.SH) * d.Wp + ox * d.SW) * d.C;
                for (Py_ssize_t c = 0; c < d.C; c += 8) {
                    v8 a = {0};
                    const float *kt = k + c;
                    for (Py_ssize_t ky = 0; ky < d.KH; ky++) {
                        const float *x = x0 + ky * d.DH * d.Wp * d.C + c;
                        for (Py_ssize_t kx = 0; kx < d.KW; kx++, kt += d.C, x += d.DW * d.C)
                            a += load8(x) * load8(kt);
                    }
                    store8(zo + c, a);
                }
            }
}

/* The kernel's gradient dk (KH, KW, C, M), summed over the batch in order, and, where dxp is not
 * NULL, the padded input's gradient: each input position gathers its taps' terms in order (no
 * scatter: one write per position). Both overwritten. */
static void NAME(dw_backward)(const float *xp, const float *dz, const float *k, float *dk,
                              float *dxp, dw_dims d) {
    const Py_ssize_t CM = d.C * d.M, T = d.KH * d.KW;
    const int vec = d.M == 1 && d.C % 8 == 0;
    for (Py_ssize_t t = 0; t < T; t++) {
        const Py_ssize_t ky = t / d.KW, kx = t % d.KW; /* once per tap */
        for (Py_ssize_t c = 0; c < d.C; c += vec ? 8 : 1) {
            if (vec) {
                v8 a = {0};
                for (Py_ssize_t b = 0; b < d.B; b++)
                    for (Py_ssize_t oy = 0; oy < d.HO; oy++)
                        for (Py_ssize_t ox = 0; ox < d.WO; ox++) {
                            const float *x = xp + ((b * d.Hp + oy * d.SH + ky * d.DH) * d.Wp +
                                                   ox * d.SW + kx * d.DW) * d.C + c;
                            a += load8(x) * load8(dz + ((b * d.HO + oy) * d.WO + ox) * CM + c);
                        }
                store8(dk + t * CM + c, a);
                continue;
            }
            for (Py_ssize_t j = 0; j < d.M; j++) {
                float a = 0.0f;
                for (Py_ssize_t b = 0; b < d.B; b++)
                    for (Py_ssize_t oy = 0; oy < d.HO; oy++)
                        for (Py_ssize_t ox = 0; ox < d.WO; ox++)
                            a += xp[((b * d.Hp + oy * d.SH + ky * d.DH) * d.Wp + ox * d.SW +
                                     kx * d.DW) * d.C + c] *
                                 dz[((b * d.HO + oy) * d.WO + ox) * CM + c * d.M + j];
                dk[t * CM + c * d.M + j] = a;
            }
        }
    }
    if (!dxp) return;
    for (Py_ssize_t b = 0; b < d.B; b++)
        for (Py_ssize_t iy = 0; iy < d.Hp; iy++)
            for (Py_ssize_t ix = 0; ix < d.Wp; ix++) {
                float *dx = dxp + ((b * d.Hp + iy) * d.Wp + ix) * d.C;
                for (Py_ssize_t c = 0; c < d.C; c += vec ? 8 : 1) {
                    v8 a = {0};
                    float s = 0.0f;
                    for (Py_ssize_t ky = 0; ky < d.KH; ky++) {
                        Py_ssize_t oy = iy - ky * d.DH;
                        if (oy < 0) break;
                        if (d.SH > 1) {
                            if (oy % d.SH) continue;
                            oy /= d.SH;
                        }
                        if (oy >= d.HO) continue;
                        for (Py_ssize_t kx = 0; kx < d.KW; kx++) {
                            Py_ssize_t ox = ix - kx * d.DW;
                            if (ox < 0) break;
                            if (d.SW > 1) {
                                if (ox % d.SW) continue;
                                ox /= d.SW;
                            }
                            if (ox >= d.WO) continue;
                            const float *g = dz + ((b * d.HO + oy) * d.WO + ox) * CM;
                            const float *kt = k + (ky * d.KW + kx) * CM;
                            if (vec)
                                a += load8(g + c) * load8(kt + c);
                            else
                                for (Py_ssize_t j = 0; j < d.M; j++)
                                    s += g[c * d.M + j] * kt[c * d.M + j];
                        }
                    }
                    if (vec)
                        store8(dx + c, a);
                    else
                        dx[c] = s;
                }
            }
}

#endif /* SET */
