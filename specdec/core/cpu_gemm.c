/* y = x w^T for bfloat16 weights on a CPU without bfloat16 instructions, in a fixed order of arithmetic.
 *
 * Where the CPU has no bf16 dot product (no avx512_bf16 or AMX), torch's bf16 GEMM falls back to a
 * reference loop: a 128-token prefill of Qwen2.5-1.5B took 19 s on a 2-core AVX2 EPYC, against
 * 3.6-4.9 s for the same forward in float32 (docs/results.md, "CPUs without bfloat16 instructions").
 * This loop reads the bf16 weights (two bytes each, widened to float32 in registers, exactly) and
 * multiplies in float32.
 *
 * Layout: the weights are packed once (cpu_gemm.py, `pack`) in panels of PANEL = 16 output columns;
 * a panel holds, for k = 0..K-1 in turn, its 16 weights of input k as 8 32-bit words, word j
 * holding column j in its low half and column 8 + j in its high half. One 32-byte load and two
 * integer operations give two vectors of 8 floats (columns 0-7 and 8-15); an x value broadcast to
 * a vector meets both, so a tile of MR rows x 16 columns keeps 2 MR accumulators in registers and
 * reads each weight once for all its rows, as the GEMM kernels of BLAS libraries do over packed
 * panels (columns in vector lanes, not a dot product per output). A draft model's int8 weights
 * (`int8_linear`, cpu_gemm.py's `pack_int8`) are packed alike, a byte a weight and the 16 columns
 * in order, widened by sign extension and conversion; an output is scaled by its column's scale at
 * the end.
 *
 * Order: an output y[m][n] is a left fold (fmaf) over k = 0..K-1 of x[m][k] w[n][k], from 0; the
 * bias, when given, is added last. So y[m][n] depends on x's row m and w's row n only: not on M, N,
 * the tile or panel group a value lands in, the thread that computes it, or whether the AVX2 path
 * or the plain loops ran (the same operations; a test builds both). That is the invariant forward's
 * row rule by construction (docs/design.md, invariant 2; tests/unit/test_cpu_gemm.py).
 *
 * Tiles: the rows of x are cut into tiles of at most MR rows, as even as they go (8 rows: two of 4,
 * not 6 and 2: a tile of few rows has too few accumulators to hide the FMA's latency). Threads take
 * groups of panels of about GROUP_BYTES, which stay in L2 while every row tile meets them; the first
 * row tile reads them from memory, and while the last one (of two or more) computes from L2, the
 * next group is fetched into L2 (else memory would idle while it computes: 8-12 rows 15-20 %
 * faster on a 2-core AVX2 EPYC).
 * Built by specdec/core/cpu_build.py with -ffp-contract=off.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VECTOR 1
#endif

#define PANEL 16
#define MR 6                        /* 12 accumulators, 2 weight vectors and x's broadcast: 15 of 16 registers */
#define GROUP_BYTES (192 * 1024)    /* panels a thread takes at a time: 4 bf16 panels at K = 1536 */

static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* rows x cols outputs (cols <= PANEL) of one panel p: x rows at x (stride K), y at y (stride ldy).
 * ahead: a panel to fetch into L2 meanwhile (or NULL). */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t K, const void *panel, const float *scale,
                                                       const float *bias, float *y, int64_t ldy, int rows, int cols,
                                                       const char *ahead, int int8) {
    const uint16_t *p = (const uint16_t *)panel;
    const int8_t *p8 = (const int8_t *)panel;
    const int64_t stride = int8 ? PANEL : 2 * PANEL; /* bytes per k */
    float out[MR][PANEL];
#ifdef VECTOR
    __m256 lo[MR], hi[MR];
    for (int r = 0; r < rows; r++) lo[r] = hi[r] = _mm256_setzero_ps();
    const __m256i high_halves = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t k = 0; k < K; k++) {
        __m256 w_lo, w_hi;
        if (int8) {
            w_lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p8 + PANEL * k))));
            w_hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p8 + PANEL * k + 8))));
        } else {
            const __m256i words = _mm256_loadu_si256((const __m256i *)(p + PANEL * k));
            w_lo = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
            w_hi = _mm256_castsi256_ps(_mm256_and_si256(words, high_halves));
        }
        if (ahead && !((k * stride) & 63)) _mm_prefetch(ahead + stride * k, _MM_HINT_T1); /* a 64-byte line */
        for (int r = 0; r < rows; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * K + k);
            lo[r] = _mm256_fmadd_ps(xb, w_lo, lo[r]);
            hi[r] = _mm256_fmadd_ps(xb, w_hi, hi[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(out[r], lo[r]);
        _mm256_storeu_ps(out[r] + 8, hi[r]);
    }
#else
    (void)ahead;
    (void)stride;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < PANEL; c++) out[r][c] = 0.0f;
    for (int64_t k = 0; k < K; k++)
        for (int c = 0; c < PANEL; c++) {
            const float w = int8 ? (float)p8[PANEL * k + c] : bf16_to_float(p[PANEL * k + (c < 8 ? 2 * c : 2 * (c - 8) + 1)]);
            for (int r = 0; r < rows; r++) out[r][c] = fmaf(x[r * K + k], w, out[r][c]);
        }
#endif
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            const float v = scale ? out[r][c] * scale[c] : out[r][c];
            y[r * ldy + c] = bias ? v + bias[c] : v;
        }
}

/* y [M, N] float32 = x [M, K] float32 (contiguous) times weights [N, K] packed in panels of `width`
 * bytes per k (bf16: 2 PANEL, int8: PANEL) transposed, times scale [N] (int8) and plus bias [N]
 * (float32, or NULL). */
static void gemm(const float *x, const char *panels, const float *scale, const float *bias, float *y, int64_t M,
                 int64_t N, int64_t K, int int8) {
    const int64_t width = int8 ? PANEL : 2 * PANEL, count = (N + PANEL - 1) / PANEL;
    int64_t per = GROUP_BYTES / (width * K);
    per = per < 1 ? 1 : per;
    const int64_t groups = (count + per - 1) / per;
    const int64_t tiles = (M + MR - 1) / MR, base = tiles ? M / tiles : 0, extra = tiles ? M % tiles : 0;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t q0 = g * per, q1 = q0 + per < count ? q0 + per : count;
        for (int64_t t = 0, m = 0; t < tiles; t++) {
            const int rows = (int)(base + (t < extra));
            for (int64_t q = q0; q < q1; q++) {
                const int64_t n = q * PANEL;
                const int cols = (int)(N - n < PANEL ? N - n : PANEL);
                const float *b = bias ? bias + n : NULL, *sc = scale ? scale + n : NULL, *xm = x + m * K;
                const char *p = panels + q * width * K;
                float *ym = y + m * N + n;
                const char *ahead = t == tiles - 1 && t > 0 && q + per < count ? p + per * width * K : NULL;
#define TILE(R)                                                             \
    (int8 ? tile(xm, K, p, sc, b, ym, N, R, cols, ahead, 1)                 \
          : tile(xm, K, p, sc, b, ym, N, R, cols, ahead, 0))
                switch (rows) {
                case 6: TILE(6); break;
                case 5: TILE(5); break;
                case 4: TILE(4); break;
                case 3: TILE(3); break;
                case 2: TILE(2); break;
                default: TILE(1); break;
                }
#undef TILE
            }
            m += rows;
        }
    }
}

/* y = x w^T + bias for bf16 w [N, K] packed by cpu_gemm.py's `pack`. */
void bf16_linear(const float *x, const uint16_t *panels, const float *bias, float *y, int64_t M, int64_t N, int64_t K) {
    gemm(x, (const char *)panels, NULL, bias, y, M, N, K, 0);
}

/* y = (x q^T) scale + bias for int8 q [N, K] packed by cpu_gemm.py's `pack_int8`: a draft model's
 * weights (specdec/core/quant.py), whose numbers may change the drafts, never the output
 * (docs/design.md, invariant 1). */
void int8_linear(const float *x, const int8_t *panels, const float *scale, const float *bias, float *y, int64_t M,
                 int64_t N, int64_t K) {
    gemm(x, (const char *)panels, scale, bias, y, M, N, K, 1);
}
