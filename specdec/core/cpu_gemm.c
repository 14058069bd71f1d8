/* y = x w^T for bfloat16 weights on a CPU without bfloat16 instructions, in a fixed order of arithmetic.
 *
 * Where the CPU has no bf16 dot product (no avx512_bf16 or AMX), torch's bf16 GEMM falls back to a
 * reference loop: a 128-token prefill of Qwen2.5-1.5B took 19 s on a 2-core AVX2 EPYC, against
 * 3.6-4.9 s for the same forward in float32 (docs/results.md, "CPUs without bfloat16 instructions").
 * This loop reads the weights as they are (two bytes each, widened to float32 in registers, exactly)
 * and multiplies in float32.
 *
 * Order: an output y[m][n] is the dot product of x's row m and w's row n (k = 0..K-1) computed as
 * LANES partial sums, lane l a left fold (fmaf) over k = l, l + LANES, ... below K rounded down to a
 * multiple of LANES; the lanes are then added as a fixed tree (pairs, then pairs of pairs); the
 * remaining k are folded on (fmaf) in order; the bias, when given, is added last. So y[m][n] depends on
 * x's row m and w's row n only: not on M, N, the tile a value lands in, the thread that computes it,
 * or whether the AVX2 path or the plain loops ran (the same operations; a test builds both). That is
 * the invariant forward's row rule by construction (docs/design.md, invariant 2;
 * tests/unit/test_cpu_gemm.py).
 *
 * Tiles: ROWS rows of x by COLS rows of w share their loads (each weight vector widened once serves
 * ROWS rows); threads take groups of column tiles, and a group meets x one row tile at a time.
 * Built by specdec/core/cpu_build.py with -ffp-contract=off.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VECTOR 1
#endif

#define LANES 8
#define ROWS 4
#define COLS 3
#define GROUP 16 /* column tiles a thread takes at a time: 48 rows of w, 147 KB at K = 1536 */

static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float lanes_sum(const float *s) {
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

/* rows x cols outputs: x rows at x (stride ldx floats), w rows at w (stride K), y at y (stride ldy). */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx, const uint16_t *w, int64_t K,
                                                       const float *bias, float *y, int64_t ldy, int rows, int cols) {
    const int64_t body = K - K % LANES;
    float part[ROWS][COLS][LANES];
#ifdef VECTOR
    __m256 acc[ROWS][COLS];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t k = 0; k < body; k += LANES) {
        __m256 wv[COLS];
        for (int c = 0; c < cols; c++) {
            const __m128i h = _mm_loadu_si128((const __m128i *)(w + c * K + k));
            wv[c] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        }
        for (int r = 0; r < rows; r++) {
            const __m256 xv = _mm256_loadu_ps(x + r * ldx + k);
            for (int c = 0; c < cols; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) _mm256_storeu_ps(part[r][c], acc[r][c]);
#else
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++)
            for (int l = 0; l < LANES; l++) part[r][c][l] = 0.0f;
    for (int64_t k = 0; k < body; k += LANES)
        for (int c = 0; c < cols; c++) {
            float wv[LANES];
            for (int l = 0; l < LANES; l++) wv[l] = bf16_to_float(w[c * K + k + l]);
            for (int r = 0; r < rows; r++)
                for (int l = 0; l < LANES; l++) part[r][c][l] = fmaf(x[r * ldx + k + l], wv[l], part[r][c][l]);
        }
#endif
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            float s = lanes_sum(part[r][c]);
            for (int64_t k = body; k < K; k++) s = fmaf(x[r * ldx + k], bf16_to_float(w[c * K + k]), s);
            y[r * ldy + c] = bias ? s + bias[c] : s;
        }
}

/* Column tiles [t0, t1) (COLS rows of w each, the last one of w's possibly fewer) against every row
 * of x: a tile of ROWS rows of x stays in L1 while it meets each of the group's columns, which stay
 * in L2. Each (rows, cols) shape is its own inlined copy. */
static void group(const float *x, int64_t M, int64_t K, const uint16_t *w, const float *bias, float *y, int64_t N,
                  int64_t t0, int64_t t1) {
    for (int64_t m = 0; m < M; m += ROWS) {
        const int rows = (int)(M - m < ROWS ? M - m : ROWS);
        for (int64_t t = t0; t < t1; t++) {
            const int64_t n = t * COLS;
            const int cols = (int)(N - n < COLS ? N - n : COLS);
            const float *b = bias ? bias + n : NULL;
#define TILE(R, C) tile(x + m * K, K, w + n * K, K, b, y + m * N + n, N, R, C)
#define ROWS_OF(C)                     \
    switch (rows) {                    \
    case 4: TILE(4, C); break;         \
    case 3: TILE(3, C); break;         \
    case 2: TILE(2, C); break;         \
    default: TILE(1, C); break;        \
    }
            if (cols == 3) {
                ROWS_OF(3)
            } else if (cols == 2) {
                ROWS_OF(2)
            } else {
                ROWS_OF(1)
            }
#undef ROWS_OF
#undef TILE
        }
    }
}

/* y [M, N] float32 = x [M, K] float32 (contiguous) times w [N, K] bfloat16 (contiguous) transposed,
 * plus bias [N] float32 (or NULL). Threads take groups of GROUP column tiles. */
void bf16_linear(const float *x, const uint16_t *w, const float *bias, float *y, int64_t M, int64_t N, int64_t K) {
    const int64_t tiles = (N + COLS - 1) / COLS, groups = (tiles + GROUP - 1) / GROUP;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t t0 = g * GROUP, t1 = t0 + GROUP < tiles ? t0 + GROUP : tiles;
        group(x, M, K, w, bias, y, N, t0, t1);
    }
}
