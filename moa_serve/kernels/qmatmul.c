/* y[M,N] = x[M,K] @ W[N,K]^T in float32, W kept in GGUF block formats and de-quantized in
 * registers (Q4_1: w = d*q + m, Q8_0: w = d*q; d*q is exact in float32, so w is bitwise the
 * value a float32 de-quantization gives), or kept as bfloat16 (widened to float32 by a 16-bit
 * shift, which is exact).
 *
 * Batch invariance by construction: every output y[i,j] is one dot product accumulated in the
 * same order (8 float lanes, k ascending, one fused multiply-add per step, then a fixed
 * horizontal sum) whatever M is, whichever tile row i falls in, however many threads run.
 *
 * Layout (repacked at load, see packed.py): Q4_1 qs uint8 [N, K/2] (per 32-block 16 bytes, byte j
 * holds element j in its low nibble and element j+16 in its high nibble, as GGUF), d and m float
 * [N, K/32]; Q8_0 qs int8 [N, K], d float [N, K/32]; bf16: uint16 [N, K] (the bit patterns).
 * K must be a multiple of 32. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NB 3      /* weight rows de-quantized and used together (4 x 3 accumulators: one FMA per load on
                     AVX2 cores that split 256-bit loads) */
#define NBD 2     /* weight rows per tile when de-quantizing straight into registers (1-2 rows of x) */
#define MT 4      /* rows of x per register tile */
#define MCHUNK 64 /* rows of x kept hot in cache per pass over the weights */

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One 32-weight block as four vectors of 8 (elements 0-7, 8-15, 16-23, 24-31). */
static inline __attribute__((always_inline)) void block_q4_1(const uint8_t *qs, float d, float m, __m256 w[4]) {
    const __m128i low = _mm_set1_epi8(0x0F);
    __m128i bytes = _mm_loadu_si128((const __m128i *)qs);
    __m128i lo = _mm_and_si128(bytes, low);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
    __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
    w[0] = _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), mv);
    w[1] = _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), mv);
    w[2] = _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), mv);
    w[3] = _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), mv);
}

static inline __attribute__((always_inline)) void block_q8_0(const int8_t *qs, float d, __m256 w[4]) {
    __m256 dv = _mm256_set1_ps(d);
    for (int c = 0; c < 4; c++)
        w[c] = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * c)))));
}

/* 8 bfloat16 values as 8 floats: a bf16 is the upper half of the float32 with the same bits. */
static inline __attribute__((always_inline)) __m256 bf16x8(const uint16_t *p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

static inline __attribute__((always_inline)) void block_bf16(const uint16_t *qs, __m256 w[4]) {
    for (int c = 0; c < 4; c++) w[c] = bf16x8(qs + 8 * c);
}

/* Block b of row n of a kind-0 (Q4_1), kind-1 (Q8_0) or kind-2 (bf16) matrix with K columns. */
static inline __attribute__((always_inline)) void block(int kind, const void *qs, const float *d, const float *m,
                                                        int64_t K, int64_t n, int64_t b, __m256 w[4]) {
    if (kind == 0)
        block_q4_1((const uint8_t *)qs + n * (K / 2) + 16 * b, d[n * (K / 32) + b], m[n * (K / 32) + b], w);
    else if (kind == 1)
        block_q8_0((const int8_t *)qs + n * K + 32 * b, d[n * (K / 32) + b], w);
    else
        block_bf16((const uint16_t *)qs + n * K + 32 * b, w);
}

static inline void dequant_row(int kind, const void *qs, const float *d, const float *m, int64_t K, int64_t n,
                               float *out) {
    for (int64_t b = 0; b < K / 32; b++) {
        __m256 w[4];
        block(kind, qs, d, m, K, n, b, w);
        for (int c = 0; c < 4; c++) _mm256_storeu_ps(out + 32 * b + 8 * c, w[c]);
    }
}

/* y[i, j] for i < mt, j < NB over de-quantized rows w [NB, K]; mt is a compile-time constant at
 * every call site, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(int mt, const float *x, int64_t K, const float *w,
                                                       float *y, int64_t ldy, int nn) {
    __m256 acc[MT][NB];
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < NB; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + K + k), w2 = _mm256_loadu_ps(w + 2 * K + k);
        for (int i = 0; i < mt; i++) {
            __m256 xv = _mm256_loadu_ps(x + i * K + k);
            acc[i][0] = _mm256_fmadd_ps(w0, xv, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(w1, xv, acc[i][1]);
            acc[i][2] = _mm256_fmadd_ps(w2, xv, acc[i][2]);
        }
    }
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nn; j++) y[i * ldy + j] = hsum(acc[i][j]);
}

/* The same sums as tile() for mt <= 2 rows of x, de-quantizing straight into registers (a
 * single-row decode step reads each weight once: no buffer round trip). Same FMA order. */
static inline __attribute__((always_inline)) void tile_direct(int kind, int mt, const float *x, int64_t K,
                                                              const void *qs, const float *d, const float *m,
                                                              int64_t n0, int nn, float *y, int64_t ldy) {
    __m256 acc[2][NBD];
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < NBD; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < K / 32; b++) {
        __m256 w0[4], w1[4];
        block(kind, qs, d, m, K, n0, b, w0);
        block(kind, qs, d, m, K, n0 + (nn > 1 ? 1 : 0), b, w1);
        for (int c = 0; c < 4; c++)
            for (int i = 0; i < mt; i++) {
                __m256 xv = _mm256_loadu_ps(x + i * K + 32 * b + 8 * c);
                acc[i][0] = _mm256_fmadd_ps(w0[c], xv, acc[i][0]);
                acc[i][1] = _mm256_fmadd_ps(w1[c], xv, acc[i][1]);
            }
    }
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nn; j++) y[i * ldy + j] = hsum(acc[i][j]);
}

static void rows(const float *x, int64_t mc, int64_t K, const float *w, float *y, int64_t ldy, int nn) {
    int64_t i = 0;
    for (; i + MT <= mc; i += MT) tile(MT, x + i * K, K, w, y + i * ldy, ldy, nn);
    switch (mc - i) {
        case 3: tile(3, x + i * K, K, w, y + i * ldy, ldy, nn); break;
        case 2: tile(2, x + i * K, K, w, y + i * ldy, ldy, nn); break;
        case 1: tile(1, x + i * K, K, w, y + i * ldy, ldy, nn); break;
        default: break;
    }
}

/* kind 0: Q4_1 (qs uint8 [N, K/2], d, m), kind 1: Q8_0 (qs int8 [N, K], d; m unused), kind 2: bf16
 * (qs uint16 [N, K]; d, m unused). */
static void matmul(int kind, const float *x, int64_t M, int64_t K, const void *qs, const float *d, const float *m,
                   int64_t N, float *y, int threads) {
    const int64_t nblocks = (N + NB - 1) / NB;
#pragma omp parallel num_threads(threads)
    {
        float *w = aligned_alloc(32, sizeof(float) * NB * K);
        for (int64_t m0 = 0; m0 < M; m0 += MCHUNK) {
            const int64_t mc = M - m0 < MCHUNK ? M - m0 : MCHUNK;
#pragma omp for schedule(guided)
            for (int64_t nb = 0; nb < nblocks; nb++) {
                const int64_t n0 = nb * NB;
                const int nn = N - n0 < NB ? (int)(N - n0) : NB;
                if (mc <= 2) {
                    for (int r = 0; r < nn; r += NBD) {
                        const int nd = nn - r < NBD ? nn - r : NBD;
                        if (mc == 1)
                            tile_direct(kind, 1, x + m0 * K, K, qs, d, m, n0 + r, nd, y + m0 * N + n0 + r, N);
                        else
                            tile_direct(kind, 2, x + m0 * K, K, qs, d, m, n0 + r, nd, y + m0 * N + n0 + r, N);
                    }
                    continue;
                }
                for (int r = 0; r < NB; r++) /* a short last block repeats a row */
                    dequant_row(kind, qs, d, m, K, n0 + (r < nn ? r : 0), w + r * K);
                rows(x + m0 * K, mc, K, w, y + m0 * N + n0, N, nn);
            }
        }
        free(w);
    }
}

/* ------------------------------------------------------------------ 8-bit activations
 * llama.cpp's CPU arithmetic for Q4_1 / Q8_0 weights (its Q8_1 / Q8_0 "vec_dot" types): each row
 * of x is rounded once per call to blocks of 32 signed 8-bit values and a float32 scale
 * (d = max|x| / 127, q = round-to-nearest(x * 127 / max|x|)), and multiplies each weight block in
 * integers (VPMADDUBSW + VPMADDWD: exact int32 sums of the 32 products), scaled by d_w * d_x in
 * float32:  y = sum_b (d_w d_x (q_w . q_x) [+ m_w d_x sum(q_x) for Q4_1]).
 *
 * Weights are interleaved 8 rows at a time (as ggml's repacked "8x8" layouts; see packed.py
 * `interleave8`): for rows 8G..8G+7 and block b, one 32-byte vector holds 4 consecutive elements
 * of each of the 8 rows, so the integer dot of a block lands one row per lane and each lane's
 * scale is a vector load: the float work (convert, scale, accumulate) is one instruction per 8
 * outputs, not per output. Q4_1: 4 vectors per block, byte 4r+e of vector v holding element 4v+e of
 * row r in its low nibble and element 16+4v+e in its high nibble; d and m float [G, K/32, 8].
 * Q8_0: 8 vectors per block, byte 4r+e of vector v = element 4v+e of row r; d float [G, K/32, 8].
 *
 * Batch invariance: a row's rounding depends on that row alone; every output is the same chain
 * (its lane: blocks ascending, the block's exact integer dot converted and multiply-added, then
 * for Q4_1 the offset term multiply-added) whatever M, the tile or the thread. AVX2, or
 * AVX512-VNNI where the CPU has it (below): the same bits. */
#define QMT 4 /* rows of x per tile */

/* x [M, K] -> q int8 [M, K], d [M, K/32] and s = d * sum(q) [M, K/32] (the Q4_1 offsets' weight). */
static void quantize_q8(const float *x, int64_t M, int64_t K, int8_t *q, float *dx, float *sx) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < M * K / 32; b++) {
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int c = 0; c < 4; c++) {
            v[c] = _mm256_loadu_ps(x + 32 * b + 8 * c);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[c]));
        }
        __m128 mx = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        mx = _mm_max_ps(mx, _mm_movehl_ps(mx, mx));
        mx = _mm_max_ss(mx, _mm_movehdup_ps(mx));
        const float maxabs = _mm_cvtss_f32(mx);
        const __m256 mul = _mm256_set1_ps(maxabs != 0.0f ? 127.0f / maxabs : 0.0f);
        __m256i i[4];
        for (int c = 0; c < 4; c++)
            i[c] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[c], mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        const __m256i sum8 = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
        _mm256_storeu_si256((__m256i *)(q + 32 * b), _mm256_permutevar8x32_epi32(packed, order));
        dx[b] = maxabs / 127.0f;
        sx[b] = dx[b] * (float)_mm_cvtsi128_si32(s4);
    }
}

static inline __attribute__((always_inline)) __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* The tiles, twice: with AVX2's VPMADDUBSW + VPMADDWD, and (compiled for AVX512-VNNI, run only
 * where the CPU has it) with VPDPBUSD, which sums the same products into the same int32 lanes in
 * one instruction: the integer dots are exact either way, so both give the same bits. */
#define X8_NAME(f) f##_avx2
#define X8_VNNI 0
#include "qmatmul_x8.h"
#undef X8_NAME
#undef X8_VNNI
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 9
#define MOA_VNNI 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512vnni")
#define X8_NAME(f) f##_vnni
#define X8_VNNI 1
#include "qmatmul_x8.h"
#undef X8_NAME
#undef X8_VNNI
#pragma GCC pop_options
#else
#define MOA_VNNI 0
#endif

static int use_vnni = 0;

/* Asks for the VNNI tiles (Python passes 1 where the CPU has avx512_vnni and avx512vl); returns
 * whether they are in use (0 when this build has none). */
int moa_int8_vnni(int wanted) {
    use_vnni = wanted && MOA_VNNI;
    return use_vnni;
}

static void x8_matmul(int kind, const float *x, int64_t M, int64_t K, const void *qs, const float *d, const float *m,
                      int64_t N, float *y, int threads) {
    int8_t *xq = aligned_alloc(32, (size_t)(M * K));
    float *dx = aligned_alloc(32, sizeof(float) * (M * K / 32 + 8));
    float *sx = aligned_alloc(32, sizeof(float) * (M * K / 32 + 8));
    quantize_q8(x, M, K, xq, dx, sx);
#if MOA_VNNI
    if (use_vnni)
        x8_rows_vnni(kind, xq, dx, sx, M, K, (const uint8_t *)qs, d, m, N, y, threads);
    else
#endif
        x8_rows_avx2(kind, xq, dx, sx, M, K, (const uint8_t *)qs, d, m, N, y, threads);
    free(xq);
    free(dx);
    free(sx);
}

/* ------------------------------------------------------------------ bfloat16 dot products
 * The same matmul with bfloat16 products (AVX512-BF16 VDPBF16PS, float32 sums): x rounded to
 * bfloat16 (nearest even) once per call, each weight de-quantized exactly as above and rounded to
 * bfloat16 the same way (the weights a bf16 copy of the float32 model holds). Twice the multiply
 * rate of float32 FMAs on CPUs that have the instruction. Batch invariance as above: every output
 * is one chain of VDPBF16PS over 16 lanes (pair p of 32-block b in lane p, b ascending) and the
 * same horizontal sum, however many rows (tiles of 1-4 rows of x over a de-quantized bf16 buffer)
 * or threads.
 * These functions are compiled for AVX-512 BF16 only (target attribute) and called only when
 * kernels/__init__.py found avx512_bf16 in the CPU flags. */
#if (defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 10)
#define MOA_BF16DOT 1 /* the compiler knows AVX512-BF16 */
#define BF16DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#define BNB 4 /* weight rows per register tile */
#define BMT 4 /* rows of x per register tile */

/* A Q4_1 block as bfloat16 by table: the block's 16 possible weights d*q + m (q = 0..15) are computed
 * and rounded once (the same float32 fused multiply-add and round-to-nearest-even as de-quantizing
 * each element, so the same bits), then VPERMW picks one per nibble: half the vector work of
 * converting and scaling all 32 elements, which at 16 rows of x was a quarter of a matmul. */
BF16DOT static inline __attribute__((always_inline)) __m512bh bf16dot_q4_1(const uint8_t *qs, float d, float m) {
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m256i table = (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(_mm512_set1_ps(d), q, _mm512_set1_ps(m)));
    const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)qs));
    const __m256i lo = _mm256_and_si256(bytes, _mm256_set1_epi16(0x0F)); /* elements 0-15 */
    const __m256i hi = _mm256_srli_epi16(bytes, 4);                      /* 16-31 */
    const __m512i idx = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    return (__m512bh)_mm512_permutexvar_epi16(idx, _mm512_castsi256_si512(table));
}

BF16DOT static inline __attribute__((always_inline)) __m512bh bf16dot_q8_0(const int8_t *qs, float d) {
    const __m512 dv = _mm512_set1_ps(d);
    const __m512 a = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qs))));
    const __m512 b = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16)))));
    return _mm512_cvtne2ps_pbh(b, a);
}

/* Block b (32 weights) of row n as bfloat16, for kind 0 (Q4_1), 1 (Q8_0) or 2 (bf16). */
BF16DOT static inline __attribute__((always_inline)) __m512bh bf16dot_block(int kind, const void *qs, const float *d,
                                                                          const float *m, int64_t K, int64_t n,
                                                                          int64_t b) {
    if (kind == 0)
        return bf16dot_q4_1((const uint8_t *)qs + n * (K / 2) + 16 * b, d[n * (K / 32) + b], m[n * (K / 32) + b]);
    if (kind == 1) return bf16dot_q8_0((const int8_t *)qs + n * K + 32 * b, d[n * (K / 32) + b]);
    return (__m512bh)_mm512_loadu_si512((const uint16_t *)qs + n * K + 32 * b);
}

/* Asks for the BNB weight rows from row n on (their blocks and scales) to be brought into cache: the
 * rows a thread's next block of the loop below most likely reads (OpenMP hands each thread runs of
 * consecutive blocks), so that they arrive while this block is computed. */
#define PREFETCH_BLOCKS 2
#define PREFETCH_MIN_ROWS 8 /* with fewer rows of x the hardware prefetcher keeps up; asking costs more */
static inline __attribute__((always_inline)) void bf16dot_prefetch(int kind, const void *qs, const float *d,
                                                                    const float *m, int64_t K, int64_t N, int64_t n) {
    if (n >= N) return;
    const int64_t rows = N - n < BNB ? N - n : BNB;
    const int64_t row_bytes = kind == 0 ? K / 2 : kind == 1 ? K : 2 * K;
    const char *q = (const char *)qs + n * row_bytes;
    for (int64_t o = 0; o < rows * row_bytes; o += 64) _mm_prefetch(q + o, _MM_HINT_T0);
    if (kind < 2)
        for (int64_t o = 0; o < rows * (K / 32) * 4; o += 64) {
            _mm_prefetch((const char *)(d + n * (K / 32)) + o, _MM_HINT_T0);
            if (kind == 0) _mm_prefetch((const char *)(m + n * (K / 32)) + o, _MM_HINT_T0);
        }
}

BF16DOT static inline float hsum16(__m512 v) {
    return hsum(_mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}

/* y[i, j] for i < mt, j < BNB over bf16 weight rows w [BNB, K] and bf16 rows of x. */
BF16DOT static inline __attribute__((always_inline)) void bf16dot_tile(int mt, const uint16_t *x, int64_t K,
                                                                     const uint16_t *w, float *y, int64_t ldy,
                                                                     int nn) {
    __m512 acc[BMT][BNB];
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < BNB; j++) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __m512bh wv[BNB];
        for (int j = 0; j < BNB; j++) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * K + k);
        for (int i = 0; i < mt; i++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * K + k);
            for (int j = 0; j < BNB; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    for (int i = 0; i < mt; i++)
        for (int j = 0; j < nn; j++) y[i * ldy + j] = hsum16(acc[i][j]);
}

BF16DOT static void bf16dot_rows(const uint16_t *x, int64_t mc, int64_t K, const uint16_t *w, float *y, int64_t ldy,
                                 int nn) {
    int64_t i = 0;
    for (; i + BMT <= mc; i += BMT) bf16dot_tile(BMT, x + i * K, K, w, y + i * ldy, ldy, nn);
    switch (mc - i) {
        case 3: bf16dot_tile(3, x + i * K, K, w, y + i * ldy, ldy, nn); break;
        case 2: bf16dot_tile(2, x + i * K, K, w, y + i * ldy, ldy, nn); break;
        case 1: bf16dot_tile(1, x + i * K, K, w, y + i * ldy, ldy, nn); break;
        default: break;
    }
}

BF16DOT static void bf16dot_matmul(int kind, const float *xf, int64_t M, int64_t K, const void *qs, const float *d,
                                   const float *m, int64_t N, float *y, int threads) {
    uint16_t *x = aligned_alloc(64, sizeof(uint16_t) * M * K); /* K is a multiple of 32: 64-byte rows */
    for (int64_t i = 0; i < M * K; i += 32)
        _mm512_storeu_si512(x + i, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xf + i + 16), _mm512_loadu_ps(xf + i)));
    const int64_t nblocks = (N + BNB - 1) / BNB;
#pragma omp parallel num_threads(threads)
    {
        uint16_t *w = aligned_alloc(64, sizeof(uint16_t) * BNB * K);
        for (int64_t m0 = 0; m0 < M; m0 += MCHUNK) {
            const int64_t mc = M - m0 < MCHUNK ? M - m0 : MCHUNK;
#pragma omp for schedule(guided)
            for (int64_t nb = 0; nb < nblocks; nb++) {
                const int64_t n0 = nb * BNB;
                const int nn = N - n0 < BNB ? (int)(N - n0) : BNB;
                /* de-quantized to bf16 first even for one row of x: straight from the blocks was
                 * slower on AVX512-BF16 (the Q8_0 LM head at one row) */
                if (mc >= PREFETCH_MIN_ROWS) bf16dot_prefetch(kind, qs, d, m, K, N, n0 + PREFETCH_BLOCKS * BNB);
                for (int r = 0; r < BNB; r++) { /* a short last block repeats a row */
                    const int64_t n = n0 + (r < nn ? r : 0);
                    for (int64_t b = 0; b < K / 32; b++)
                        _mm512_storeu_si512(w + r * K + 32 * b, (__m512i)bf16dot_block(kind, qs, d, m, K, n, b));
                }
                bf16dot_rows(x + m0 * K, mc, K, w, y + m0 * N + n0, N, nn);
            }
        }
        free(w);
    }
    free(x);
}
#undef BNB
#undef BMT
#else
#define MOA_BF16DOT 0
#endif

/* 1 when this build has the bfloat16-product kernels (Python checks the CPU flags too). */
int moa_bf16dot_compiled(void) { return MOA_BF16DOT; }

/* Any packed matmul by kind: 0 Q4_1, 1 Q8_0, 2 bf16 with float32 products; 3, 4, 5 the same
 * weights with bfloat16 products (only where the CPU has AVX512-BF16); 6 Q4_1, 7 Q8_0 with 8-bit x
 * (weights interleaved 8 rows at a time: see x8_tile). */
void moa_packed_matmul(int kind, const float *x, int64_t M, int64_t K, const void *qs, const float *d, const float *m,
                       int64_t N, float *y, int threads) {
    if (kind < 3) {
        matmul(kind, x, M, K, qs, d, m, N, y, threads);
        return;
    }
    if (kind == 6 || kind == 7) {
        x8_matmul(kind - 6, x, M, K, qs, d, m, N, y, threads);
        return;
    }
#if MOA_BF16DOT
    bf16dot_matmul(kind - 3, x, M, K, qs, d, m, N, y, threads);
#else
    abort(); /* unreachable: Python asks moa_bf16dot_compiled() first */
#endif
}

/* Rows `ids` of a Q8_0 / Q4_1 matrix, de-quantized (embedding lookups, checks). */
void moa_q8_0_rows(const int8_t *qs, const float *d, int64_t K, const int64_t *ids, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) dequant_row(1, qs, d, NULL, K, ids[i], out + i * K);
}

void moa_q4_1_rows(const uint8_t *qs, const float *d, const float *m, int64_t K, const int64_t *ids, int64_t n,
                   float *out) {
    for (int64_t i = 0; i < n; i++) dequant_row(0, qs, d, m, K, ids[i], out + i * K);
}

/* Causal attention of packed new tokens over a slot KV cache: token t (slot slots[t], position
 * pos[t]) attends to its slot's keys 0..pos[t]. q, out [n, H, hd] float32; k, v: one layer of the
 * cache, float32 or (kv_bf16) bfloat16 widened in registers, element (slot, kv head, position, dim)
 * at slot*ss + head*hs + position*ps + dim. hd must be a multiple of 8, at most 256.
 * The query heads that share a KV head (grouped-query attention) are taken together, up to 3 at a
 * time, so each K/V block is read once for all of them; scores are computed 8 positions at a time
 * (8 dot-product accumulators reduced together).
 * Fixed order everywhere: each score is the same 8-lane FMA chain and the same reduction tree
 * whatever else is computed beside it, the softmax sum runs over 8 lanes in ascending blocks, and
 * the weighted sum of values over positions ascending; so a token's output depends neither on the
 * other tokens of the call nor on how heads are grouped into tasks. */
static inline __attribute__((always_inline)) __m256 load8(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16x8((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}

/* lane r = the horizontal sum of a[r] (each lane's tree depends on a[r] alone) */
static inline __attribute__((always_inline)) __m256 hsum8(const __m256 a[8]) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline __m256 exp8(__m256 x);

#define TASK_HEADS 3 /* query heads of one KV group per attention task, at most */

/* The cache offset of key/value j of a token attending to `len` keys: position j, except the last
 * one (the token's own K/V), which sits `extra` elements further (a tree-draft alternative stored
 * past the chain it branches from; 0 for every other token). The order of the arithmetic is the
 * same either way, so an alternative's output is bitwise the one its token gets in a chain. */
#define KEYROW(j) (base + (j) * ps + ((j) == len - 1 ? extra : 0))

/* Softmax numerators of one (token, head): s[0..len) = exp(q.k_j * scale - max); returns their sum.
 * s has room for len rounded up to 8. */
static inline __attribute__((always_inline)) float scores(int kv_bf16, const float *qv, int64_t hd, const void *k,
                                                          int64_t base, int64_t ps, int64_t len, int64_t extra,
                                                          float scale, float *s) {
    const __m256 vscale = _mm256_set1_ps(scale);
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    int64_t j0 = 0;
    for (; j0 + 8 <= len; j0 += 8) {
        __m256 acc[8];
        for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t d = 0; d < hd; d += 8) {
            const __m256 qd = _mm256_loadu_ps(qv + d);
            for (int r = 0; r < 8; r++)
                acc[r] = _mm256_fmadd_ps(qd, load8(k, KEYROW(j0 + r) + d, kv_bf16), acc[r]);
        }
        const __m256 sc = _mm256_mul_ps(hsum8(acc), vscale);
        _mm256_storeu_ps(s + j0, sc);
        vmax = _mm256_max_ps(vmax, sc);
    }
    if (j0 < len) { /* the last, partial block: the same chain per lane, absent lanes zero */
        __m256 acc[8];
        for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
        for (int r = 0; r < len - j0; r++)
            for (int64_t d = 0; d < hd; d += 8)
                acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qv + d), load8(k, KEYROW(j0 + r) + d, kv_bf16), acc[r]);
        _mm256_storeu_ps(s + j0, _mm256_mul_ps(hsum8(acc), vscale));
        for (int64_t j = j0; j < len; j++) vmax = _mm256_max_ps(vmax, _mm256_set1_ps(s[j]));
    }
    float lanes[8], mx = -INFINITY;
    _mm256_storeu_ps(lanes, vmax);
    for (int r = 0; r < 8; r++) mx = lanes[r] > mx ? lanes[r] : mx;
    const __m256 vmx = _mm256_set1_ps(mx), idx = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 vsum = _mm256_setzero_ps();
    for (j0 = 0; j0 < len; j0 += 8) {
        const __m256 live = _mm256_cmp_ps(_mm256_add_ps(idx, _mm256_set1_ps((float)j0)),
                                          _mm256_set1_ps((float)len), _CMP_LT_OQ);
        const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j0), vmx)), live);
        _mm256_storeu_ps(s + j0, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    return hsum(vsum);
}

/* scores() for the hc query heads of one KV group over a bfloat16 cache (s + a * sstride for head
 * a): each block of 8 keys is widened to float32 once, into kb, and read from there by every head
 * (rather than widened again per head). The arithmetic of each score, its max and its sum is
 * scores()'s exactly: the same FMA chain over the dimensions, the same reduction tree, the same
 * lane order. inv[a] = 1 / (head a's sum). */
static inline __attribute__((always_inline)) void scores_heads_bf16(const float *q, int64_t hc, int64_t hd,
                                                                    const uint16_t *k, int64_t base, int64_t ps,
                                                                    int64_t len, int64_t extra, float scale,
                                                                    float *s, int64_t sstride, float *inv) {
    float kb[8 * 256] __attribute__((aligned(32)));
    const __m256 vscale = _mm256_set1_ps(scale);
    __m256 vmax[TASK_HEADS];
    for (int64_t a = 0; a < hc; a++) vmax[a] = _mm256_set1_ps(-INFINITY);
    for (int64_t j0 = 0; j0 < len; j0 += 8) {
        const int64_t rows = len - j0 < 8 ? len - j0 : 8;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t d = 0; d < hd; d += 8)
                _mm256_store_ps(kb + r * hd + d, bf16x8(k + KEYROW(j0 + r) + d));
        for (int64_t a = 0; a < hc; a++) {
            const float *qv = q + a * hd;
            __m256 acc[8];
            for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
            if (rows == 8) {
                for (int64_t d = 0; d < hd; d += 8) {
                    const __m256 qd = _mm256_loadu_ps(qv + d);
                    for (int r = 0; r < 8; r++) acc[r] = _mm256_fmadd_ps(qd, _mm256_load_ps(kb + r * hd + d), acc[r]);
                }
            } else { /* the last, partial block: the same chain per lane, absent lanes zero */
                for (int64_t r = 0; r < rows; r++)
                    for (int64_t d = 0; d < hd; d += 8)
                        acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(qv + d), _mm256_load_ps(kb + r * hd + d), acc[r]);
            }
            const __m256 sc = _mm256_mul_ps(hsum8(acc), vscale);
            float *sa = s + a * sstride;
            _mm256_storeu_ps(sa + j0, sc);
            if (rows == 8)
                vmax[a] = _mm256_max_ps(vmax[a], sc);
            else
                for (int64_t j = j0; j < len; j++) vmax[a] = _mm256_max_ps(vmax[a], _mm256_set1_ps(sa[j]));
        }
    }
    const __m256 idx = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t a = 0; a < hc; a++) {
        float lanes[8], mx = -INFINITY, *sa = s + a * sstride;
        _mm256_storeu_ps(lanes, vmax[a]);
        for (int r = 0; r < 8; r++) mx = lanes[r] > mx ? lanes[r] : mx;
        const __m256 vmx = _mm256_set1_ps(mx);
        __m256 vsum = _mm256_setzero_ps();
        for (int64_t j0 = 0; j0 < len; j0 += 8) {
            const __m256 live = _mm256_cmp_ps(_mm256_add_ps(idx, _mm256_set1_ps((float)j0)),
                                              _mm256_set1_ps((float)len), _CMP_LT_OQ);
            const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(sa + j0), vmx)), live);
            _mm256_storeu_ps(sa + j0, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        inv[a] = 1.0f / hsum(vsum);
    }
}

/* out (HC heads, DV vectors of 8 dims from d0) = sum_j p[h][j] v_j / sum[h], j ascending */
static inline __attribute__((always_inline)) void weigh_values(int HC, int DV, int kv_bf16, const float *p,
                                                               int64_t pstride, const void *v, int64_t base,
                                                               int64_t ps, int64_t len, int64_t extra, int64_t d0,
                                                               const float *inv, float *out, int64_t ostride) {
    __m256 o[TASK_HEADS][4];
    for (int a = 0; a < HC; a++)
        for (int b = 0; b < DV; b++) o[a][b] = _mm256_setzero_ps();
    for (int64_t j = 0; j < len; j++) {
        __m256 pb[TASK_HEADS];
        for (int a = 0; a < HC; a++) pb[a] = _mm256_set1_ps(p[a * pstride + j]);
        for (int b = 0; b < DV; b++) {
            const __m256 vv = load8(v, KEYROW(j) + d0 + 8 * b, kv_bf16);
            for (int a = 0; a < HC; a++) o[a][b] = _mm256_fmadd_ps(pb[a], vv, o[a][b]);
        }
    }
    for (int a = 0; a < HC; a++)
        for (int b = 0; b < DV; b++)
            _mm256_storeu_ps(out + a * ostride + d0 + 8 * b, _mm256_mul_ps(o[a][b], _mm256_set1_ps(inv[a])));
}

#define WEIGH(HC, DV) weigh_values(HC, DV, kv_bf16, s, sstride, v, base, ps, len, extra, d0, inv, ov, hd)

static inline __attribute__((always_inline)) void attention(int kv_bf16, const float *q, int64_t n, int64_t H,
                                                            int64_t KVH, int64_t hd, const void *k, const void *v,
                                                            int64_t ss, int64_t hs, int64_t ps, const int64_t *slots,
                                                            const int64_t *pos, const int64_t *store_at, float scale,
                                                            float *out, int64_t max_len, int threads) {
    const int64_t groups = H / KVH, sstride = (max_len + 7) / 8 * 8;
    /* heads per task: up to 3 of one group; single heads when there are too few tasks to share */
    const int64_t per = n * KVH < 4 * threads ? 1 : (groups < TASK_HEADS ? groups : TASK_HEADS);
    const int64_t chunks = (groups + per - 1) / per, tasks = n * KVH * chunks;
#pragma omp parallel num_threads(threads)
    {
        float *s = aligned_alloc(32, sizeof(float) * sstride * TASK_HEADS);
#pragma omp for schedule(dynamic, 2)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t t = task / (KVH * chunks), g = task / chunks % KVH, c = task % chunks;
            const int64_t h0 = g * groups + c * per, hc = groups - c * per < per ? groups - c * per : per;
            const int64_t len = pos[t] + 1, base = slots[t] * ss + g * hs; /* (slot, kv head, 0, 0) */
            const int64_t extra = store_at ? (store_at[t] - pos[t]) * ps : 0; /* where its own K/V is stored */
            float inv[TASK_HEADS];
            if (kv_bf16 && hc > 1)
                scores_heads_bf16(q + (t * H + h0) * hd, hc, hd, (const uint16_t *)k, base, ps, len, extra, scale, s,
                                  sstride, inv);
            else
                for (int64_t a = 0; a < hc; a++)
                    inv[a] = 1.0f / scores(kv_bf16, q + (t * H + h0 + a) * hd, hd, k, base, ps, len, extra, scale,
                                           s + a * sstride);
            float *ov = out + (t * H + h0) * hd;
            for (int64_t d0 = 0; d0 < hd; d0 += 32) {
                const int64_t dv = (hd - d0) / 8 < 4 ? (hd - d0) / 8 : 4;
                switch (hc * 4 + dv) {
                    case 5: WEIGH(1, 1); break; case 6: WEIGH(1, 2); break;
                    case 7: WEIGH(1, 3); break; case 8: WEIGH(1, 4); break;
                    case 9: WEIGH(2, 1); break; case 10: WEIGH(2, 2); break;
                    case 11: WEIGH(2, 3); break; case 12: WEIGH(2, 4); break;
                    case 13: WEIGH(3, 1); break; case 14: WEIGH(3, 2); break;
                    case 15: WEIGH(3, 3); break; default: WEIGH(3, 4); break;
                }
            }
        }
        free(s);
    }
}
#undef WEIGH
#undef KEYROW
#undef TASK_HEADS

void moa_attention(const float *q, int64_t n, int64_t H, int64_t KVH, int64_t hd, const float *k, const float *v,
                   int64_t ss, int64_t hs, int64_t ps, const int64_t *slots, const int64_t *pos, const int64_t *store_at,
                   float scale, float *out, int64_t max_len, int threads) {
    attention(0, q, n, H, KVH, hd, k, v, ss, hs, ps, slots, pos, store_at, scale, out, max_len, threads);
}

/* The same over a bfloat16 cache (k, v uint16 bit patterns; q and out stay float32). */
void moa_attention_bf16(const float *q, int64_t n, int64_t H, int64_t KVH, int64_t hd, const uint16_t *k,
                        const uint16_t *v, int64_t ss, int64_t hs, int64_t ps, const int64_t *slots, const int64_t *pos,
                        const int64_t *store_at, float scale, float *out, int64_t max_len, int threads) {
    attention(1, q, n, H, KVH, hd, k, v, ss, hs, ps, slots, pos, store_at, scale, out, max_len, threads);
}

/* ------------------------------------------------------------------ fused decoder layers
 * The whole stack of Llama decoder layers over packed new tokens in one call, so that a decode
 * step pays no per-op Python and dispatch cost (about half of a one-session step otherwise).
 * Per layer: RMSNorm, fused q/k/v projection, rotary embedding, K/V written to the slot cache,
 * attention (the kernel above), output projection + residual, RMSNorm, fused gate/up, SiLU(gate)
 * * up, down projection + residual. Every element is computed alone in a fixed order (norm sums
 * in 8 lanes then the fixed horizontal sum, the matmuls above), so a token's output still does not
 * depend on the other tokens of the call. */

/* exp(x) for 8 floats (Cephes' single-precision polynomial, about 1 ulp): used by SiLU. */
static inline __m256 exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-88.3762626647949f);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    fx = _mm256_floor_ps(fx);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, z, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* out[i] = w * (x[i] * rsqrt(mean(x[i]^2) + eps)) for n rows of width H (a multiple of 8). */
static void rmsnorm_rows(const float *x, int64_t n, int64_t H, const float *w, float eps, float *out) {
    for (int64_t i = 0; i < n; i++) {
        const float *xr = x + i * H;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t k = 0; k < H; k += 8) {
            __m256 v = _mm256_loadu_ps(xr + k);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        const __m256 r = _mm256_set1_ps(1.0f / sqrtf(hsum(acc) / (float)H + eps));
        for (int64_t k = 0; k < H; k += 8)
            _mm256_storeu_ps(out + i * H + k, _mm256_mul_ps(_mm256_loadu_ps(w + k),
                                                            _mm256_mul_ps(_mm256_loadu_ps(xr + k), r)));
    }
}

/* x (one head, hd values) rotated: out[j] = x[j] cos[j] - x[j+hd/2] sin[j], out[j+hd/2] =
 * x[j+hd/2] cos[j+hd/2] + x[j] sin[j+hd/2]. */
static inline void rope_head(const float *x, const float *c, const float *s, int64_t hd, float *out) {
    const int64_t half = hd / 2;
    for (int64_t j = 0; j < half; j++) {
        out[j] = x[j] * c[j] - x[j + half] * s[j];
        out[j + half] = x[j + half] * c[j + half] + x[j] * s[j + half];
    }
}

/* x += y over `count` floats (a multiple of 8): the residual connections. */
static inline void add_rows(float *x, const float *y, int64_t count) {
    for (int64_t i = 0; i < count; i += 8)
        _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
}

/* One matrix of a layer as the int64 parameter block describes it: kind (as moa_packed_matmul), qs, d, m, N. */
static inline void layer_matmul(const int64_t *p, const float *x, int64_t M, int64_t K, float *y, int threads) {
    moa_packed_matmul((int)p[0], x, M, K, (const void *)p[1], (const float *)p[2], (const float *)p[3], p[4], y, threads);
}

#define LP_NORM1 0
#define LP_NORM2 1
#define LP_QKV 2   /* kind, qs, d, m, N at 2..6 */
#define LP_O 7     /* 7..11 */
#define LP_GU 12   /* 12..16 */
#define LP_DOWN 17 /* 17..21 */
#define LP_K 22    /* the layer's K cache [slots, KVH, max_len, hd] */
#define LP_V 23
#define LP_SIZE 24

/* float32 -> bfloat16 bits, round to nearest even (NaN -> the quiet NaN 0x7FC0): as torch's
 * float32 -> bfloat16 conversion, so a K/V written here equals the per-layer path's cache write. */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* One head's K (rotated) or V row into the cache: float32, or bfloat16 bits when kv_bf16. */
static inline void store_head(int kv_bf16, const float *row, void *cache, int64_t at, int64_t hd) {
    if (!kv_bf16) {
        memcpy((float *)cache + at, row, sizeof(float) * hd);
        return;
    }
    uint16_t *dst = (uint16_t *)cache + at;
    for (int64_t j = 0; j < hd; j++) dst[j] = to_bf16(row[j]);
}

/* x [n, H] float32, updated in place through `layers` layers; params [layers, LP_SIZE]; cos/sin
 * [n, hd]; slots/pos [n]: each token's cache slot and position; cache strides (elements) ss, hs,
 * ps and max_len (positions per slot) are those of every layer's K and V, float32 or, with
 * kv_bf16, bfloat16 (K/V rounded once when written; attention reads them widened). store_at [n]
 * (or NULL: pos): the cache position each token's K/V is written to, when it is not its own
 * position (a tree-draft alternative: see KEYROW). */
void moa_decoder_layers(float *x, int64_t n, int64_t H, int64_t layers, const int64_t *params, float eps,
                        int64_t heads, int64_t kv_heads, int64_t hd, int64_t inter, const float *cos,
                        const float *sin, const int64_t *slots, const int64_t *pos, const int64_t *store_at, int64_t ss,
                        int64_t hs, int64_t ps, int64_t max_len, int kv_bf16, int threads) {
    const int64_t nq = heads * hd, nkv = kv_heads * hd, wqkv = nq + 2 * nkv;
    float *h = aligned_alloc(32, sizeof(float) * n * H);
    float *qkv = aligned_alloc(32, sizeof(float) * n * wqkv);
    float *q = aligned_alloc(32, sizeof(float) * n * nq);
    float *att = aligned_alloc(32, sizeof(float) * n * nq);
    float *gu = aligned_alloc(32, sizeof(float) * n * 2 * inter);
    float *act = aligned_alloc(32, sizeof(float) * n * inter);
    float *y = aligned_alloc(32, sizeof(float) * n * H);
    float *kr = aligned_alloc(32, sizeof(float) * ((hd + 7) / 8 * 8)); /* one rotated key head */
    const float scale = 1.0f / sqrtf((float)hd);
    for (int64_t l = 0; l < layers; l++) {
        const int64_t *p = params + l * LP_SIZE;
        void *kc = (void *)p[LP_K], *vc = (void *)p[LP_V];
        rmsnorm_rows(x, n, H, (const float *)p[LP_NORM1], eps, h);
        layer_matmul(p + LP_QKV, h, n, H, qkv, threads);
        for (int64_t t = 0; t < n; t++) {
            const float *row = qkv + t * wqkv, *c = cos + t * hd, *s = sin + t * hd;
            for (int64_t a = 0; a < heads; a++) rope_head(row + a * hd, c, s, hd, q + (t * heads + a) * hd);
            for (int64_t g = 0; g < kv_heads; g++) {
                const int64_t at = slots[t] * ss + g * hs + (store_at ? store_at[t] : pos[t]) * ps;
                rope_head(row + nq + g * hd, c, s, hd, kr);
                store_head(kv_bf16, kr, kc, at, hd);
                store_head(kv_bf16, row + nq + nkv + g * hd, vc, at, hd);
            }
        }
        attention(kv_bf16, q, n, heads, kv_heads, hd, kc, vc, ss, hs, ps, slots, pos, store_at, scale, att, max_len,
                  threads);
        layer_matmul(p + LP_O, att, n, nq, y, threads);
        add_rows(x, y, n * H);
        rmsnorm_rows(x, n, H, (const float *)p[LP_NORM2], eps, h);
        layer_matmul(p + LP_GU, h, n, H, gu, threads);
        for (int64_t t = 0; t < n; t++)
            for (int64_t j = 0; j < inter; j += 8) {
                const __m256 g = _mm256_loadu_ps(gu + t * 2 * inter + j), u = _mm256_loadu_ps(gu + t * 2 * inter + inter + j);
                const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
                const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
                _mm256_storeu_ps(act + t * inter + j, _mm256_mul_ps(silu, u));
            }
        layer_matmul(p + LP_DOWN, act, n, inter, y, threads);
        add_rows(x, y, n * H);
    }
    free(h); free(qkv); free(q); free(att); free(gu); free(act); free(y); free(kr);
}
