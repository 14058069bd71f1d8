/* A decoder layer's operations on one row at a time, on a CPU: the RMS norm and the rotary embedding.
 *
 * torch runs each of these as 6-10 small ops of 5-100 us each at a decode step's one or few rows
 * (conversions, a reduction, elementwise passes, allocations); here each is one call of a few us.
 * Values are bfloat16 (`bf16` = 1: rounded to nearest even after every operation that torch rounds
 * after, so the same roundings as its bf16 ops) or float32 (`bf16` = 0: a drafter's activations).
 *
 * rms_norm: y = w * (h * (1 / sqrt(mean(h^2) + eps))), h the row in float32. The sum of squares is
 * a fixed fold: LANES partial sums over the elements i = j (mod LANES), folded left to right, then
 * the rest in order. So a row's result depends on nothing but the row (docs/design.md, invariant 2).
 * In bf16, h * (1 / sqrt(...)) is rounded to bf16 before the product with w, as HF's Llama and
 * Qwen2 norms do.
 *
 * rotary: x[d] cos[d] - x[d + D/2] sin[d] and x[d + D/2] cos[d + D/2] + x[d] sin[d + D/2], in place,
 * each product and the sum rounded as torch's `x * cos + rotate_half(x) * sin` rounds them: the same
 * bits.
 *
 * Built by specdec/core/cpu_rows.py with -ffp-contract=off: no multiply and add fused behind the
 * source's back.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 8

static inline float from_bf16(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, as torch's float -> bfloat16 (a NaN becomes its canonical quiet NaN). */
static inline uint16_t to_bf16(float f) {
    if (isnan(f)) {
        return 0x7FC0;
    }
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

static inline float load(const void *p, int64_t i, int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* A value as the op's result dtype holds it: rounded to bf16 (and back), or as is. */
static inline float held(float f, int bf16) { return bf16 ? from_bf16(to_bf16(f)) : f; }

static inline void store(void *p, int64_t i, float f, int bf16) {
    if (bf16) {
        ((uint16_t *)p)[i] = to_bf16(f);
    } else {
        ((float *)p)[i] = f;
    }
}

/* x [rows, n] (row stride x_stride elements), w [n] bf16, out [rows, n] contiguous. */
void rms_norm(const void *x, int64_t x_stride, const uint16_t *w, void *out, int64_t rows, int64_t n, float eps,
              int bf16) {
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)x + r * x_stride * (bf16 ? 2 : 4);
        float part[LANES] = {0};
        const int64_t whole = n - n % LANES;
        for (int64_t i = 0; i < whole; i += LANES) {
            for (int j = 0; j < LANES; j++) {
                const float h = load(row, i + j, bf16);
                part[j] += h * h;
            }
        }
        float sum = part[0];
        for (int j = 1; j < LANES; j++) {
            sum += part[j];
        }
        for (int64_t i = whole; i < n; i++) {
            const float h = load(row, i, bf16);
            sum += h * h;
        }
        const float inv = 1.0f / sqrtf(sum / (float)n + eps);
        char *dst = (char *)out + r * n * (bf16 ? 2 : 4);
        for (int64_t i = 0; i < n; i++) {
            const float y = held(load(row, i, bf16) * inv, bf16);
            store(dst, i, from_bf16(w[i]) * y, bf16);
        }
    }
}

/* x [rows, heads, dim] in place (row stride x_stride, head stride head_stride elements; a head's
 * dim elements contiguous); cos, sin [rows, dim] contiguous, in x's dtype. */
void rotary(void *x, int64_t x_stride, int64_t head_stride, const void *cos, const void *sin, int64_t rows,
            int64_t heads, int64_t dim, int bf16) {
    const int64_t half = dim / 2;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t h = 0; h < heads; h++) {
            const int64_t at = r * x_stride + h * head_stride, t = r * dim;
            for (int64_t d = 0; d < half; d++) {
                const float a = load(x, at + d, bf16), b = load(x, at + d + half, bf16);
                const float ca = load(cos, t + d, bf16), sa = load(sin, t + d, bf16);
                const float cb = load(cos, t + d + half, bf16), sb = load(sin, t + d + half, bf16);
                store(x, at + d, held(a * ca, bf16) + held(-b * sa, bf16), bf16);
                store(x, at + d + half, held(b * cb, bf16) + held(a * sb, bf16), bf16);
            }
        }
    }
}
