/* Matmuls over weights kept in groups of 32 (quant/groups.py), float32 activations.

   y[M, N] = x[M, K] @ W^T, W row n, group g (32 values):
     int4: w = q * d + m, q in 0..15; byte j of a group holds value j (low nibble) and
           value j + 16 (high nibble), the layout of GGUF's Q4_0/Q4_1 blocks, so those load
           without a change of values;
     int8: w = q * d, q in -127..127 (GGUF's Q8_0).
   d, m: float16. Per output: the sum over groups of d * (q . x) (+ m * sum(x) for int4),
   each group's dot product in float32 lanes. The order of the sum depends on K and on
   the path (one activation row, 2-32 rows, or more: widened), never on the values of
   the other rows.

   Why our own kernel: torch's _weight_int4pack_mm_for_cpu / _weight_int8pack_mm measured
   0.01-0.85x of float32 F.linear on this CPU (tools/bench_quant.py); this one unpacks a
   group into float32 lanes (AVX2, or AVX-512 where the compiler targets it) and reuses it
   for up to 4 activation rows. Built with the machine's compiler at first use (native.py). */
#include <stdint.h>
#include <immintrin.h>

#define MB 4
static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

#ifdef __AVX512F__
#define VEC __m512
#define NV 2
#define VZERO _mm512_setzero_ps()
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VFMA _mm512_fmadd_ps
#define VMUL _mm512_mul_ps
#define VSET1 _mm512_set1_ps
static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }
static inline void int4_unpack(const uint8_t* qb, VEC w[NV]) {
  __m128i raw = _mm_loadu_si128((const __m128i*)qb), m4 = _mm_set1_epi8(15);
  w[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, m4)));
  w[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), m4)));
}
static inline void int8_unpack(const int8_t* qb, VEC w[NV]) {
  w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)qb)));
  w[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(qb + 16))));
}
#else
#define VEC __m256
#define NV 4
#define VZERO _mm256_setzero_ps()
#define VLOAD _mm256_loadu_ps
#define VSTORE _mm256_storeu_ps
#define VFMA _mm256_fmadd_ps
#define VMUL _mm256_mul_ps
#define VSET1 _mm256_set1_ps
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline void int4_unpack(const uint8_t* qb, VEC w[NV]) {
  __m128i raw = _mm_loadu_si128((const __m128i*)qb), m4 = _mm_set1_epi8(15);
  __m128i lo = _mm_and_si128(raw, m4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}
static inline void int8_unpack(const int8_t* qb, VEC w[NV]) {
  for (int i = 0; i < 4; i++)
    w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(qb + 8 * i))));
}
#endif
#define LANES (32 / NV)

/* One output row n for activation rows r0 .. r0 + mb - 1. */
static inline void row_int4(int K, const float* x, const float* xs, int r0, int mb, const uint8_t* qr,
                            const uint16_t* dr, const uint16_t* mr, int n, int N, float* y) {
  int G = K / 32;
  VEC acc[MB]; float macc[MB];
  for (int i = 0; i < MB; i++) { acc[i] = VZERO; macc[i] = 0; }
  for (int g = 0; g < G; g++) {
    VEC w[NV]; int4_unpack(qr + g * 16, w);
    VEC dg = VSET1(h2f(dr[g])); float mg = h2f(mr[g]);
    for (int i = 0; i < mb; i++) {
      const float* xb = x + (int64_t)(r0 + i) * K + g * 32;
      VEC t = VMUL(w[0], VLOAD(xb));
      for (int v = 1; v < NV; v++) t = VFMA(w[v], VLOAD(xb + v * LANES), t);
      acc[i] = VFMA(dg, t, acc[i]);
      macc[i] += mg * xs[(r0 + i) * G + g];
    }
  }
  for (int i = 0; i < mb; i++) y[(int64_t)(r0 + i) * N + n] = hsum(acc[i]) + macc[i];
}

/* One activation row (decode at batch 1), the hot case: two groups per iteration into
   two accumulators (independent chains). `unpack` is int4_unpack or int8_unpack (a
   constant at each call: the compiler inlines it), `gbytes` a group's bytes. Returns
   sum_g d * (q . x); the int4 min term is added by the caller as one dot product of the
   row's mins with the groups' sums instead of a scalar step per group. */
typedef void (*unpack_fn)(const void*, VEC*);
static inline float row_one(int K, const float* x, const uint8_t* qr, int gbytes, unpack_fn unpack,
                            const uint16_t* dr) {
  int G = K / 32, g = 0;
  VEC a0 = VZERO, a1 = VZERO;
  for (; g + 1 < G; g += 2) {
    VEC w[NV], u[NV];
    unpack(qr + g * gbytes, w);
    unpack(qr + (g + 1) * gbytes, u);
    const float* xb = x + g * 32;
    VEC t = VMUL(w[0], VLOAD(xb)), s = VMUL(u[0], VLOAD(xb + 32));
    for (int v = 1; v < NV; v++) {
      t = VFMA(w[v], VLOAD(xb + v * LANES), t);
      s = VFMA(u[v], VLOAD(xb + 32 + v * LANES), s);
    }
    a0 = VFMA(VSET1(h2f(dr[g])), t, a0);
    a1 = VFMA(VSET1(h2f(dr[g + 1])), s, a1);
  }
  if (g < G) {
    VEC w[NV]; unpack(qr + g * gbytes, w);
    const float* xb = x + g * 32;
    VEC t = VMUL(w[0], VLOAD(xb));
    for (int v = 1; v < NV; v++) t = VFMA(w[v], VLOAD(xb + v * LANES), t);
    a0 = VFMA(VSET1(h2f(dr[g])), t, a0);
  }
  return hsum(a0) + hsum(a1);
}

static inline float min_term(int G, const uint16_t* mr, const float* xs) {
  float s = 0;
  for (int i = 0; i < G; i++) s += h2f(mr[i]) * xs[i];
  return s;
}

void int4_mm(int M, int N, int K, const float* x, const uint8_t* q, const uint16_t* d,
             const uint16_t* m, float* xs, float* y) {
  int G = K / 32;  /* xs: caller's [M, G] scratch for the groups' sums of x (the m term) */
  for (int r = 0; r < M; r++)
    for (int g = 0; g < G; g++) {
      float s = 0;
      for (int j = 0; j < 32; j++) s += x[(int64_t)r * K + g * 32 + j];
      xs[r * G + g] = s;
    }
  if (M == 1) {
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
      y[n] = row_one(K, x, q + (int64_t)n * (K / 2), 16, (unpack_fn)int4_unpack, d + (int64_t)n * G) +
             min_term(G, m + (int64_t)n * G, xs);
    return;
  }
  #pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++)
    for (int r0 = 0; r0 < M; r0 += MB) {
      const uint8_t* qr = q + (int64_t)n * (K / 2);
      if (M - r0 >= MB)  /* a constant count: the compiler keeps the accumulators in registers */
        row_int4(K, x, xs, r0, MB, qr, d + (int64_t)n * G, m + (int64_t)n * G, n, N, y);
      else
        row_int4(K, x, xs, r0, M - r0, qr, d + (int64_t)n * G, m + (int64_t)n * G, n, N, y);
    }
}

static inline void row_int8(int K, const float* x, int r0, int mb, const int8_t* qr, const uint16_t* dr,
                            int n, int N, float* y) {
  int G = K / 32;
  VEC acc[MB];
  for (int i = 0; i < MB; i++) acc[i] = VZERO;
  for (int g = 0; g < G; g++) {
    VEC w[NV]; int8_unpack(qr + g * 32, w);
    VEC dg = VSET1(h2f(dr[g]));
    for (int i = 0; i < mb; i++) {
      const float* xb = x + (int64_t)(r0 + i) * K + g * 32;
      VEC t = VMUL(w[0], VLOAD(xb));
      for (int v = 1; v < NV; v++) t = VFMA(w[v], VLOAD(xb + v * LANES), t);
      acc[i] = VFMA(dg, t, acc[i]);
    }
  }
  for (int i = 0; i < mb; i++) y[(int64_t)(r0 + i) * N + n] = hsum(acc[i]);
}

void int8_mm(int M, int N, int K, const float* x, const int8_t* q, const uint16_t* d, float* y) {
  int G = K / 32;
  if (M == 1) {
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++)
      y[n] = row_one(K, x, (const uint8_t*)q + (int64_t)n * K, 32, (unpack_fn)int8_unpack, d + (int64_t)n * G);
    return;
  }
  #pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++)
    for (int r0 = 0; r0 < M; r0 += MB) {
      if (M - r0 >= MB)
        row_int8(K, x, r0, MB, q + (int64_t)n * K, d + (int64_t)n * G, n, N, y);
      else
        row_int8(K, x, r0, M - r0, q + (int64_t)n * K, d + (int64_t)n * G, n, N, y);
    }
}

/* Rows of W as float32 (out[N, K]): many activation rows (a prefill chunk) are multiplied
   by a float GEMM over this copy instead (its cost is paid once for the chunk). */
void int4_dequant(int N, int K, const uint8_t* q, const uint16_t* d, const uint16_t* m, float* out) {
  int G = K / 32;
  #pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++)
    for (int g = 0; g < G; g++) {
      VEC w[NV]; int4_unpack(q + (int64_t)n * (K / 2) + g * 16, w);
      VEC dg = VSET1(h2f(d[(int64_t)n * G + g])), mg = VSET1(h2f(m[(int64_t)n * G + g]));
      for (int v = 0; v < NV; v++) VSTORE(out + (int64_t)n * K + g * 32 + v * LANES, VFMA(w[v], dg, mg));
    }
}

void int8_dequant(int N, int K, const int8_t* q, const uint16_t* d, float* out) {
  int G = K / 32;
  #pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++)
    for (int g = 0; g < G; g++) {
      VEC w[NV]; int8_unpack(q + (int64_t)n * K + g * 32, w);
      VEC dg = VSET1(h2f(d[(int64_t)n * G + g]));
      for (int v = 0; v < NV; v++) VSTORE(out + (int64_t)n * K + g * 32 + v * LANES, VMUL(w[v], dg));
    }
}
