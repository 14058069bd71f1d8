/* Invariant attention on a CPU: loops whose order of arithmetic is fixed by construction.
 *
 * A query (one head at one position of one row) is computed over the keys its bias row shows
 * (bias == 0), in key order. Its score with a key is a left fold over the head dimension (fmaf); the
 * softmax subtracts the exact maximum (order-free) and takes exp_nonpositive, a polynomial whose every
 * step is one IEEE operation rounded once (so a vector lane and a scalar give the same bits); the
 * weights' sum is a float64 left fold over the keys and the weighted sum of values a float32 left fold
 * (fmaf) per element of the head dimension. A hidden key's weight is an exact 0 and adds nothing.
 * So a query's result does not depend on the batch, the query width, the span, the other queries, or
 * how the work is split into tasks, lanes and threads (docs/design.md, invariant 2;
 * tests/unit/test_cpu_attention.py).
 *
 * The work goes in tasks: up to POSITIONS query positions of one row with all the heads that share
 * one kv head. The task's queries are the vector lanes of the score loop (each key row is converted
 * to float32 once and read by all of them); the head dimension is the lanes of the value loop. With
 * AVX-512, or AVX2 and FMA, those loops are written in its intrinsics, elsewhere as plain loops: the
 * same operations in the same order, so the same bits (a test builds each and compares them).
 * Built by specdec/core/cpu_attention.py with -ffp-contract=off (the compiler fuses no multiply and
 * add on its own; where a fused one is wanted it is written, fmaf) and -fno-trapping-math (which lets
 * it vectorise exp_nonpositive; it changes no value).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define POSITIONS 8
#define LANES 16     /* queries per vector of the score loop */
#define KEYS 4       /* keys the score loop takes at a time (independent sums) */
#define KEY_BLOCK 64 /* value rows converted to float32 at a time */

static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* e^x for x <= 0 (a score minus its query's maximum): Cephes' expf, range reduction by n = round(x
 * log2 e) and a degree-6 polynomial, about 1 ulp; 0 below -87 (e^x is then under float's normal
 * range). */
#pragma omp declare simd notinbranch
static inline float exp_nonpositive(float x) {
    const float n = floorf(fmaf(x, 1.44269504088896341f, 0.5f));
    float r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)(n < -126.0f ? -126.0f : n) + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.0f ? 0.0f : p * scale;
}

/* `count` rows of a key or value matrix from row `first` (row stride `stride` elements, each row
 * contiguous) as float32 into out[count][dim]. */
static void load_rows(const void *base, int bf16, int64_t stride, int first, int count, int dim, float *out) {
    for (int i = 0; i < count; i++) {
        const int64_t at = (int64_t)(first + i) * stride;
        if (bf16) {
            const uint16_t *src = (const uint16_t *)base + at;
            for (int d = 0; d < dim; d++) out[(int64_t)i * dim + d] = bf16_to_float(src[d]);
        } else {
            memcpy(out + (int64_t)i * dim, (const float *)base + at, sizeof(float) * dim);
        }
    }
}

/* scores[k][r] = sum over d of qT[d][r] * keys[k][d], a left fold over d (fmaf), for KEYS keys and
 * `lanes` queries (a multiple of LANES). */
#ifdef __AVX512F__
#define SCORE_LOOP(V)                                                                                         \
    static void scores_##V(const float *qT, const float *keys, int dim, float *scores) {                    \
        __m512 acc[KEYS][V];                                                                                  \
        for (int k = 0; k < KEYS; k++)                                                                        \
            for (int v = 0; v < V; v++) acc[k][v] = _mm512_setzero_ps();                                      \
        for (int d = 0; d < dim; d++) {                                                                       \
            __m512 qd[V];                                                                                     \
            for (int v = 0; v < V; v++) qd[v] = _mm512_loadu_ps(qT + (int64_t)d * V * LANES + v * LANES);    \
            for (int k = 0; k < KEYS; k++) {                                                                  \
                const __m512 x = _mm512_set1_ps(keys[k * dim + d]);                                           \
                for (int v = 0; v < V; v++) acc[k][v] = _mm512_fmadd_ps(qd[v], x, acc[k][v]);                 \
            }                                                                                                 \
        }                                                                                                     \
        for (int k = 0; k < KEYS; k++)                                                                        \
            for (int v = 0; v < V; v++) _mm512_storeu_ps(scores + (k * V + v) * LANES, acc[k][v]);          \
    }
SCORE_LOOP(1)
SCORE_LOOP(2)
SCORE_LOOP(3)
SCORE_LOOP(4)
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 has 16 registers of 8 lanes: NV vectors of queries against NK keys at a time (NK * NV
 * accumulators), the KEYS keys in KEYS / NK passes. Each score is still its own left fold over d. */
#define SCORE_LOOP(NV, NK)                                                                                   \
    static void scores_##NV(const float *qT, const float *keys, int dim, float *scores) {                  \
        for (int k0 = 0; k0 < KEYS; k0 += NK) {                                                              \
            __m256 acc[NK][NV];                                                                              \
            for (int k = 0; k < NK; k++)                                                                     \
                for (int v = 0; v < NV; v++) acc[k][v] = _mm256_setzero_ps();                                \
            for (int d = 0; d < dim; d++) {                                                                  \
                for (int k = 0; k < NK; k++) {                                                               \
                    const __m256 x = _mm256_set1_ps(keys[(k0 + k) * dim + d]);                               \
                    for (int v = 0; v < NV; v++)                                                             \
                        acc[k][v] = _mm256_fmadd_ps(_mm256_loadu_ps(qT + (int64_t)d * NV * 8 + v * 8), x, acc[k][v]); \
                }                                                                                            \
            }                                                                                                \
            for (int k = 0; k < NK; k++)                                                                     \
                for (int v = 0; v < NV; v++) _mm256_storeu_ps(scores + ((k0 + k) * NV + v) * 8, acc[k][v]);   \
        }                                                                                                    \
    }
SCORE_LOOP(2, 4)
SCORE_LOOP(4, 2)
SCORE_LOOP(6, 2)
SCORE_LOOP(8, 1)
#endif

static void score_keys(const float *qT, const float *keys, int dim, int lanes, float *scores) {
#ifdef __AVX512F__
    switch (lanes / LANES) {
    case 1: scores_1(qT, keys, dim, scores); return;
    case 2: scores_2(qT, keys, dim, scores); return;
    case 3: scores_3(qT, keys, dim, scores); return;
    case 4: scores_4(qT, keys, dim, scores); return;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    switch (lanes / 8) {
    case 2: scores_2(qT, keys, dim, scores); return;
    case 4: scores_4(qT, keys, dim, scores); return;
    case 6: scores_6(qT, keys, dim, scores); return;
    case 8: scores_8(qT, keys, dim, scores); return;
    }
#endif
    for (int k = 0; k < KEYS; k++)
        for (int r = 0; r < lanes; r++) {
            float acc = 0.0f;
            for (int d = 0; d < dim; d++) acc = fmaf(qT[(int64_t)d * lanes + r], keys[k * dim + d], acc);
            scores[k * lanes + r] = acc;
        }
}

/* out[d] += w[i * lanes] * values[i][d] over the keys i it sees (seen[i * lanes]), a left fold over i
 * (fmaf) continuing the one already in out. */
static void add_values(const float *w, int lanes, const int32_t *seen, int count, const float *values, int dim,
                       float *out) {
#ifdef __AVX512F__
    if (dim == 128 || dim == 64) {
        const int chunks = dim / LANES;
        __m512 acc[8];
        for (int c = 0; c < 8; c++) acc[c] = c < chunks ? _mm512_loadu_ps(out + c * LANES) : _mm512_setzero_ps();
        for (int i = 0; i < count; i++) {
            if (!seen[(int64_t)i * lanes]) continue;
            const __m512 wi = _mm512_set1_ps(w[(int64_t)i * lanes]);
            const float *v = values + (int64_t)i * dim;
            if (chunks == 8)
                for (int c = 0; c < 8; c++) acc[c] = _mm512_fmadd_ps(wi, _mm512_loadu_ps(v + c * LANES), acc[c]);
            else
                for (int c = 0; c < 4; c++) acc[c] = _mm512_fmadd_ps(wi, _mm512_loadu_ps(v + c * LANES), acc[c]);
        }
        for (int c = 0; c < chunks; c++) _mm512_storeu_ps(out + c * LANES, acc[c]);
        return;
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if (dim % 64 == 0) { /* 64 elements (8 registers) at a time; each element's fold over i is unchanged */
        for (int c0 = 0; c0 < dim; c0 += 64) {
            __m256 acc[8];
            for (int c = 0; c < 8; c++) acc[c] = _mm256_loadu_ps(out + c0 + c * 8);
            for (int i = 0; i < count; i++) {
                if (!seen[(int64_t)i * lanes]) continue;
                const __m256 wi = _mm256_set1_ps(w[(int64_t)i * lanes]);
                const float *v = values + (int64_t)i * dim + c0;
                for (int c = 0; c < 8; c++) acc[c] = _mm256_fmadd_ps(wi, _mm256_loadu_ps(v + c * 8), acc[c]);
            }
            for (int c = 0; c < 8; c++) _mm256_storeu_ps(out + c0 + c * 8, acc[c]);
        }
        return;
    }
#endif
    for (int i = 0; i < count; i++) {
        if (!seen[(int64_t)i * lanes]) continue;
        const float wi = w[(int64_t)i * lanes];
        for (int d = 0; d < dim; d++) out[d] = fmaf(wi, values[(int64_t)i * dim + d], out[d]);
    }
}

/* q: [batch, heads, width, dim] float32, already scaled; keys, values: bfloat16 (bf16 = 1) or float32,
 * element (b, h, s, d) at rows[b] + h * sh + s * ss + d (rows: each batch row's first element, so
 * the rows can be slots of a cache read in place); bias: [batch, width, span] float32, 0 where a
 * key is visible; out: [batch, heads, width, dim] float32. Head h reads kv head h / (heads / kv_heads).
 * A query that sees no key gets zeros. Returns 0, or -1 if a buffer could not be allocated. */
int invariant_attention(const float *q, const void *keys, const void *values, int bf16, const int64_t *krows,
                        int64_t ksh, int64_t kss, const int64_t *vrows, int64_t vsh, int64_t vss, const float *bias,
                        float *out, int batch, int heads, int kv_heads, int width, int span, int dim) {
    const int group = heads / kv_heads;
    const int tiles = (width + POSITIONS - 1) / POSITIONS;
    const int most = (POSITIONS * group + LANES - 1) / LANES * LANES; /* lanes of the widest task */
    const int64_t tasks = (int64_t)batch * kv_heads * tiles;
    const size_t keys_room = (size_t)(span + KEYS) * most; /* every key of the span, and a last group of KEYS */
    int failed = 0;
#pragma omp parallel
    {
        float *qT = malloc(sizeof(float) * (size_t)dim * most);
        float *w = malloc(sizeof(float) * keys_room);
        int32_t *seen = malloc(sizeof(int32_t) * keys_room);
        float *rows = malloc(sizeof(float) * (size_t)KEY_BLOCK * dim);
        float *top = malloc(sizeof(float) * most);
        double *total = malloc(sizeof(double) * most);
        const int ready = qT && w && seen && rows && top && total;
        if (!ready) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < tasks; task++) {
            if (!ready) continue;
            const int tile = (int)(task % tiles), kv = (int)(task / tiles % kv_heads), b = (int)(task / tiles / kv_heads);
            const int t0 = tile * POSITIONS, nt = width - t0 < POSITIONS ? width - t0 : POSITIONS;
            const int used = nt * group, lanes = (used + LANES - 1) / LANES * LANES; /* lane r: position r / group */
            const float *mask = bias + ((int64_t)b * width + t0) * span;
            const char *kbase = (const char *)keys + (krows[b] + kv * ksh) * (bf16 ? 2 : 4);
            const char *vbase = (const char *)values + (vrows[b] + kv * vsh) * (bf16 ? 2 : 4);
            int last = 0; /* keys [0, last) hold every key a query of the task sees */
            for (int tt = 0; tt < nt; tt++)
                for (int j = span - 1; j >= last; j--)
                    if (mask[(int64_t)tt * span + j] == 0.0f) {
                        last = j + 1;
                        break;
                    }
            for (int r = 0; r < lanes; r++) {
                const float *qr = q + (((int64_t)b * heads + kv * group + r % group) * width + t0 + r / group) * dim;
                for (int d = 0; d < dim; d++) qT[(int64_t)d * lanes + r] = r < used ? qr[d] : 0.0f;
            }
            for (int r = 0; r < lanes; r++) {
                const float *visible = mask + (int64_t)(r < used ? r / group : 0) * span;
                for (int j = 0; j < last; j++) seen[(int64_t)j * lanes + r] = r < used && visible[j] == 0.0f;
            }
            for (int j0 = 0; j0 < last; j0 += KEYS) {
                const int count = last - j0 < KEYS ? last - j0 : KEYS;
                load_rows(kbase, bf16, kss, j0, count, dim, rows);
                memset(rows + (int64_t)count * dim, 0, sizeof(float) * (size_t)(KEYS - count) * dim);
                score_keys(qT, rows, dim, lanes, w + (int64_t)j0 * lanes);
            }
            for (int r = 0; r < lanes; r++) top[r] = -INFINITY;
            for (int j = 0; j < last; j++)
#pragma omp simd
                for (int r = 0; r < lanes; r++) {
                    const float s = w[(int64_t)j * lanes + r];
                    top[r] = seen[(int64_t)j * lanes + r] && s > top[r] ? s : top[r];
                }
            for (int j = 0; j < last; j++) {
                float *wj = w + (int64_t)j * lanes;
                const int32_t *sj = seen + (int64_t)j * lanes;
#pragma omp simd
                for (int r = 0; r < lanes; r++) {
                    const float e = exp_nonpositive(wj[r] - top[r]);
                    wj[r] = sj[r] ? e : 0.0f;
                }
            }
            for (int r = 0; r < lanes; r++) total[r] = 0.0;
            for (int j = 0; j < last; j++)
#pragma omp simd
                for (int r = 0; r < lanes; r++) total[r] += w[(int64_t)j * lanes + r];
            for (int r = 0; r < used; r++) {
                float *o = out + (((int64_t)b * heads + kv * group + r % group) * width + t0 + r / group) * dim;
                memset(o, 0, sizeof(float) * dim);
            }
            for (int j0 = 0; j0 < last; j0 += KEY_BLOCK) {
                const int count = last - j0 < KEY_BLOCK ? last - j0 : KEY_BLOCK;
                load_rows(vbase, bf16, vss, j0, count, dim, rows);
                for (int r = 0; r < used; r++) {
                    float *o = out + (((int64_t)b * heads + kv * group + r % group) * width + t0 + r / group) * dim;
                    add_values(w + (int64_t)j0 * lanes + r, lanes, seen + (int64_t)j0 * lanes + r, count, rows, dim, o);
                }
            }
            for (int r = 0; r < used; r++) {
                float *o = out + (((int64_t)b * heads + kv * group + r % group) * width + t0 + r / group) * dim;
                if (total[r] > 0.0)
                    for (int d = 0; d < dim; d++) o[d] = (float)(o[d] / total[r]);
            }
        }
        free(qT);
        free(w);
        free(seen);
        free(rows);
        free(top);
        free(total);
    }
    return failed ? -1 : 0;
}
