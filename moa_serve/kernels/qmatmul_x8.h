/* The 8-bit-product tiles of qmatmul.c (see the comment above quantize_q8 there), included twice:
 * X8_NAME(f) names this copy's functions, X8_VNNI says whether VPDPBUSD (AVX512-VNNI) sums the
 * products or VPMADDUBSW + VPMADDWD (AVX2) do. Not a header to include anywhere else. */

/* y[i, 8G + r] for i < mt rows of quantized x (from row i0) and the 8 rows of group G (nn < 8 of
 * them stored: the last group). */
static inline __attribute__((always_inline)) void X8_NAME(x8_tile)(int kind, int mt, const int8_t *xq, const float *dx,
                                                          const float *sx, int64_t K, const uint8_t *w,
                                                          const float *d, const float *m, int nn, float *y,
                                                          int64_t ldy) {
    const int64_t nb = K / 32;
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
    __m256 acc[QMT];
    for (int i = 0; i < mt; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i dot[QMT];
        if (kind == 0) { /* u4 x s8 pairs sum to at most 2*15*127 = 3810: 8 of them fit in int16 */
            __m256i s16[QMT];
            for (int i = 0; i < mt; i++) s16[i] = dot[i] = _mm256_setzero_si256();
            for (int v = 0; v < 4; v++) {
                const __m256i packed = _mm256_loadu_si256((const __m256i *)(w + 128 * b + 32 * v));
                const __m256i lo = _mm256_and_si256(packed, low), hi = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
                for (int i = 0; i < mt; i++) {
                    const int8_t *xb = xq + i * K + 32 * b;
#if X8_VNNI
                    dot[i] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(dot[i], lo, bcast4(xb + 4 * v)), hi, bcast4(xb + 16 + 4 * v));
#else
                    s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(lo, bcast4(xb + 4 * v)));
                    s16[i] = _mm256_add_epi16(s16[i], _mm256_maddubs_epi16(hi, bcast4(xb + 16 + 4 * v)));
#endif
                }
            }
            if (!X8_VNNI)
                for (int i = 0; i < mt; i++) dot[i] = _mm256_madd_epi16(s16[i], ones);
        } else { /* s8 x s8 through |w| x sign(x, w); a pair sums to at most 2*128*127: int32 at once */
            for (int i = 0; i < mt; i++) dot[i] = _mm256_setzero_si256();
            for (int v = 0; v < 8; v++) {
                const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + 256 * b + 32 * v));
                const __m256i wabs = _mm256_sign_epi8(wv, wv);
                for (int i = 0; i < mt; i++) {
                    const __m256i xs = _mm256_sign_epi8(bcast4(xq + i * K + 32 * b + 4 * v), wv);
#if X8_VNNI
                    dot[i] = _mm256_dpbusd_epi32(dot[i], wabs, xs);
#else
                    dot[i] = _mm256_add_epi32(dot[i], _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, xs), ones));
#endif
                }
            }
        }
        const __m256 dw = _mm256_loadu_ps(d + 8 * b);
        for (int i = 0; i < mt; i++) {
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i]), _mm256_mul_ps(dw, _mm256_set1_ps(dx[i * nb + b])), acc[i]);
            if (kind == 0) acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(m + 8 * b), _mm256_set1_ps(sx[i * nb + b]), acc[i]);
        }
    }
    for (int i = 0; i < mt; i++) {
        if (nn == 8) {
            _mm256_storeu_ps(y + i * ldy, acc[i]);
        } else {
            float out[8];
            _mm256_storeu_ps(out, acc[i]);
            memcpy(y + i * ldy, out, sizeof(float) * nn);
        }
    }
}

/* kind 0: Q4_1, 1: Q8_0 over quantized x. */
static inline __attribute__((always_inline)) void X8_NAME(x8_kind_rows)(int kind, const int8_t *xq, const float *dx,
                                                          const float *sx, int64_t M, int64_t K, const uint8_t *qs,
                                                          const float *d, const float *m, int64_t N, float *y,
                                                          int threads) {
    const int64_t nb = K / 32, groups = (N + 7) / 8;
    const int64_t group_bytes = (kind == 0 ? 4 : 8) * K; /* 8 rows of K/2 or K bytes */
#pragma omp parallel for num_threads(threads) schedule(guided)
    for (int64_t g = 0; g < groups; g++) {
        const int nn = N - 8 * g < 8 ? (int)(N - 8 * g) : 8;
        const uint8_t *w = qs + g * group_bytes;
        const float *dg = d + g * nb * 8, *mg = kind == 0 ? m + g * nb * 8 : NULL;
        for (int64_t i = 0; i < M; i += QMT) {
            const int8_t *xi = xq + i * K;
            const float *di = dx + i * nb, *si = sx + i * nb;
            float *yi = y + i * N + 8 * g;
            switch (M - i < QMT ? M - i : QMT) {
                case 4: X8_NAME(x8_tile)(kind, 4, xi, di, si, K, w, dg, mg, nn, yi, N); break;
                case 3: X8_NAME(x8_tile)(kind, 3, xi, di, si, K, w, dg, mg, nn, yi, N); break;
                case 2: X8_NAME(x8_tile)(kind, 2, xi, di, si, K, w, dg, mg, nn, yi, N); break;
                default: X8_NAME(x8_tile)(kind, 1, xi, di, si, K, w, dg, mg, nn, yi, N); break;
            }
        }
    }
}

/* Inlined per kind, so the tiles have no branches. */
static void X8_NAME(x8_rows)(int kind, const int8_t *xq, const float *dx, const float *sx, int64_t M, int64_t K,
                             const uint8_t *qs, const float *d, const float *m, int64_t N, float *y, int threads) {
    if (kind == 0)
        X8_NAME(x8_kind_rows)(0, xq, dx, sx, M, K, qs, d, m, N, y, threads);
    else
        X8_NAME(x8_kind_rows)(1, xq, dx, sx, M, K, qs, d, m, N, y, threads);
}
