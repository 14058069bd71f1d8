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
 * the tile or block a value lands in, the thread that computes it, or whether the AVX2 path
 * or the plain loops ran (the same operations; a test builds both). That is the invariant forward's
 * row rule by construction (docs/design.md, invariant 2; tests/unit/test_cpu_gemm.py).
 *
 * Tiles: the rows of x are cut into tiles of at most MR rows, as even as they go (8 rows: two of 4,
 * not 6 and 2: a tile of few rows has too few accumulators to hide the FMA's latency). Threads take
 * panels in turn; a panel is read in blocks of KB values of k, and up to CHUNK row tiles meet each
 * block while it is in L1, their accumulators kept between blocks (storing and reloading a float
 * leaves the fold as it was). The first tile to meet a block reads it from memory and fetches the
 * weights AHEAD bytes on (the hardware prefetcher alone left memory partly idle: on a 2-core AVX2
 * EPYC, 1-2 rows 1.15-1.2x and 5 rows 1.3x faster with it, docs/results.md).
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
#define KB 256                      /* a block of k: 8 KB of a bf16 panel, which stays in L1 while every row tile meets it */
#define CHUNK 4                     /* row tiles that meet a block together (more re-read the panel from L2) */
#define AHEAD 8192                  /* bytes ahead of the reading position fetched into L2 meanwhile */

static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* acc[rows][PANEL] continues its left fold over k with x[rows, k0..k1) w^T for one panel (x rows at
 * x, stride K). first: the first row tile to meet this block, which reads it from memory and fetches
 * the weights AHEAD bytes on into L2 as it goes (the rest meet the block in L1). */
static inline __attribute__((always_inline)) void fold(const float *x, int64_t K, const void *panel, int64_t k0,
                                                       int64_t k1, float (*acc)[PANEL], int rows, int first, int int8) {
    const uint16_t *p = (const uint16_t *)panel;
    const int8_t *p8 = (const int8_t *)panel;
    const int64_t stride = int8 ? PANEL : 2 * PANEL; /* bytes per k */
#ifdef VECTOR
    __m256 lo[MR], hi[MR];
    for (int r = 0; r < rows; r++) {
        lo[r] = _mm256_loadu_ps(acc[r]);
        hi[r] = _mm256_loadu_ps(acc[r] + 8);
    }
    /* a prefetch each k, several to a line (cheaper than a branch); a later tile's are of its block, in L1 */
    const char *fetch = (const char *)panel + (first ? AHEAD : 0);
    const __m256i high_halves = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t k = k0; k < k1; k++) {
        __m256 w_lo, w_hi;
        if (int8) {
            w_lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p8 + PANEL * k))));
            w_hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p8 + PANEL * k + 8))));
        } else {
            const __m256i words = _mm256_loadu_si256((const __m256i *)(p + PANEL * k));
            w_lo = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
            w_hi = _mm256_castsi256_ps(_mm256_and_si256(words, high_halves));
        }
        _mm_prefetch(fetch + stride * k, _MM_HINT_T1);
        for (int r = 0; r < rows; r++) {
            const __m256 xb = _mm256_broadcast_ss(x + r * K + k);
            lo[r] = _mm256_fmadd_ps(xb, w_lo, lo[r]);
            hi[r] = _mm256_fmadd_ps(xb, w_hi, hi[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(acc[r], lo[r]);
        _mm256_storeu_ps(acc[r] + 8, hi[r]);
    }
#else
    (void)first;
    (void)stride;
    for (int64_t k = k0; k < k1; k++)
        for (int c = 0; c < PANEL; c++) {
            const float w = int8 ? (float)p8[PANEL * k + c] : bf16_to_float(p[PANEL * k + (c < 8 ? 2 * c : 2 * (c - 8) + 1)]);
            for (int r = 0; r < rows; r++) acc[r][c] = fmaf(x[r * K + k], w, acc[r][c]);
        }
#endif
}

/* y [M, N] float32 = x [M, K] float32 (contiguous) times weights [N, K] packed in panels of `width`
 * bytes per k (bf16: 2 PANEL, int8: PANEL) transposed, times scale [N] (int8) and plus bias [N]
 * (float32, or NULL). */
static void gemm(const float *x, const char *panels, const float *scale, const float *bias, float *y, int64_t M,
                 int64_t N, int64_t K, int int8) {
    const int64_t width = int8 ? PANEL : 2 * PANEL, count = (N + PANEL - 1) / PANEL;
    const int64_t tiles = (M + MR - 1) / MR, base = tiles ? M / tiles : 0, extra = tiles ? M % tiles : 0;
#define FIRST_ROW(t) ((t) * base + ((t) < extra ? (t) : extra)) /* tile t's first row; t < extra: base + 1 rows */
#pragma omp parallel for schedule(static)
    for (int64_t q = 0; q < count; q++) {
        const int64_t n = q * PANEL;
        const int cols = (int)(N - n < PANEL ? N - n : PANEL);
        const char *p = panels + q * width * K;
        for (int64_t t0 = 0; t0 < tiles; t0 += CHUNK) {
            const int64_t t1 = t0 + CHUNK < tiles ? t0 + CHUNK : tiles;
            float acc[CHUNK][MR][PANEL];
            memset(acc, 0, sizeof acc);
            for (int64_t k0 = 0; k0 < K; k0 += KB) {
                const int64_t k1 = k0 + KB < K ? k0 + KB : K;
                for (int64_t t = t0; t < t1; t++) {
                    const float *xm = x + FIRST_ROW(t) * K;
                    float (*a)[PANEL] = acc[t - t0];
                    const int first = t == t0;
#define FOLD(R) (int8 ? fold(xm, K, p, k0, k1, a, R, first, 1) : fold(xm, K, p, k0, k1, a, R, first, 0))
                    switch (FIRST_ROW(t + 1) - FIRST_ROW(t)) {
                    case 6: FOLD(6); break;
                    case 5: FOLD(5); break;
                    case 4: FOLD(4); break;
                    case 3: FOLD(3); break;
                    case 2: FOLD(2); break;
                    default: FOLD(1); break;
                    }
#undef FOLD
                }
            }
            for (int64_t t = t0; t < t1; t++)
                for (int64_t m = FIRST_ROW(t); m < FIRST_ROW(t + 1); m++)
                    for (int c = 0; c < cols; c++) {
                        const float a = acc[t - t0][m - FIRST_ROW(t)][c], v = scale ? a * scale[n + c] : a;
                        y[m * N + n + c] = bias ? v + bias[n + c] : v;
                    }
        }
    }
#undef FIRST_ROW
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
