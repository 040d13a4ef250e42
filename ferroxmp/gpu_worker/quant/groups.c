/* Matmuls over weights kept in groups of 32 (quant/groups.py), float32 activations: int8
   groups, and float32 rows through the same blocks.

   y[M, N] = x[M, K] @ W^T, W row n, group g (32 values):
     int8: w = q * d, q in -127..127 (GGUF's Q8_0), d float16;
     float32: the values as they are (f32_mm).
   Per output: the sum over groups of d * (q . x), each group's dot product in float32
   lanes. The order of the sum depends on K and on the path (one activation row, 2-32
   rows, or more: widened), never on the values of the other rows. int4 has its own
   layout and kernel (int4x16.c), included after this file.

   Why our own kernel: torch's _weight_int8pack_mm measured 0.01-0.85x of float32
   F.linear on this CPU (tools/bench_quant.py); this one unpacks a group into float32 lanes
   (AVX2, or AVX-512 where the compiler targets it) and reuses it for several activation
   rows. Built with the machine's compiler at first use (native.py). */
#include <stdint.h>
#include <immintrin.h>

#ifndef PREFETCH
#define PREFETCH 2048
#endif
static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

#ifdef __AVX512F__
#define VEC __m512
#define NV 2
#define VZERO _mm512_setzero_ps()
#define VLOAD _mm512_loadu_ps
#define VSTORE _mm512_storeu_ps
#define VFMA _mm512_fmadd_ps
#define VMUL _mm512_mul_ps
#define VADD _mm512_add_ps
#define VSET1 _mm512_set1_ps
static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }
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
#define VADD _mm256_add_ps
#define VSET1 _mm256_set1_ps
static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline void int8_unpack(const int8_t* qb, VEC w[NV]) {
  for (int i = 0; i < 4; i++)
    w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(qb + 8 * i))));
}
#endif
#define LANES (32 / NV)

/* One activation row (decode at batch 1), the hot case: two groups per iteration into
   two accumulators (independent chains). `unpack` is a constant at each call (the
   compiler inlines it), `gbytes` a group's bytes. Returns sum_g d * (q . x). */
typedef void (*unpack_fn)(const void*, VEC*);
static inline float row_one(int K, const float* x, const uint8_t* qr, int gbytes, unpack_fn unpack,
                            const uint16_t* dr) {
  int G = K / 32, g = 0;
  VEC a0 = VZERO, a1 = VZERO;
  for (; g + 1 < G; g += 2) {
    VEC w[NV], u[NV];
    _mm_prefetch((const char*)(qr + g * gbytes) + PREFETCH, _MM_HINT_T0);
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

/* Several activation rows (a batch of decode rows, a small chunk): output rows n .. n+nr-1
   for activation rows r0 .. r0+mb-1. Each group is unpacked once per block into its float
   values q * d, the values int8_dequant writes, and multiplied by every row of the
   block, each activation load serving the block's nr weight rows: the unpack is paid once
   per mb rows and the loads once per nr rows. A row's sum runs over the same values in the
   same order whatever the other rows hold. Called with constant nr and mb (rows_times), so
   that the accumulators stay in registers. */
#ifdef __AVX512F__
#define NSTEP 4  /* output rows per parallel step: a block of 4 x (up to 4) activation rows */
#define NWIDE 2  /* output rows per block of 5-8 activation rows (32 registers) */
#else
#define NSTEP 1  /* 16 registers: one output row per block */
#define NWIDE 1
#endif
#define MR 8
static inline __attribute__((always_inline)) void block(int K, const float* x, int r0, int mb, int n, int nr,
    int N, const uint8_t* q, int gbytes, unpack_fn unpack, const uint16_t* d, float* y) {
  int G = K / 32;
  VEC acc[NSTEP][MR];
  for (int j = 0; j < nr; j++)
    for (int i = 0; i < mb; i++) acc[j][i] = VZERO;
  for (int g = 0; g < G; g++) {
    VEC w[NSTEP][NV];
    for (int j = 0; j < nr; j++) {
      const uint8_t* qg = q + ((int64_t)(n + j) * G + g) * gbytes;
      if (!d) {  /* float32 rows (f32_mm): the values as they are */
        /* the same group NSTEP rows on, both of its lines: the thread's next block (static
           schedule), fetched while this one computes; the hardware prefetchers lose four
           short interleaved rows (2-6 KB each): +20-27% read rate at 4-16 rows
           (docs/BENCHMARKS.md 23). Quantized blocks are bound by the unpack (neutral). */
        const char* pf = (const char*)qg + (int64_t)NSTEP * G * gbytes;
        _mm_prefetch(pf, _MM_HINT_T0);
        _mm_prefetch(pf + 64, _MM_HINT_T0);
        unpack(qg, w[j]);
        continue;
      }
      _mm_prefetch((const char*)qg + PREFETCH, _MM_HINT_T0);
      unpack(qg, w[j]);
      VEC dg = VSET1(h2f(d[(int64_t)(n + j) * G + g]));
      for (int v = 0; v < NV; v++) w[j][v] = VMUL(w[j][v], dg);
    }
    for (int i = 0; i < mb; i++) {
      const float* xb = x + (int64_t)(r0 + i) * K + g * 32;
      for (int v = 0; v < NV; v++) {
        VEC xv = VLOAD(xb + v * LANES);
        for (int j = 0; j < nr; j++) acc[j][i] = VFMA(w[j][v], xv, acc[j][i]);
      }
    }
  }
  for (int j = 0; j < nr; j++)
    for (int i = 0; i < mb; i++) y[(int64_t)(r0 + i) * N + n + j] = hsum(acc[j][i]);
}

/* Every activation row times output rows n .. n+NSTEP-1. Called inside each format's own
   parallel loop (one OpenMP region outlined for both formats would call `unpack` through
   a pointer). */
static inline __attribute__((always_inline)) void rows_times(int n, int M, int N, int K, const float* x,
    const uint8_t* q, int gbytes, unpack_fn unpack, const uint16_t* d, float* y) {
  for (int r0 = 0; r0 < M; r0 += MR) {
    int mb = M - r0 < MR ? M - r0 : MR;
    if (N - n < NSTEP) {  /* the last output rows of an N that NSTEP does not divide */
      for (int j = n; j < N; j++) block(K, x, r0, mb, j, 1, N, q, gbytes, unpack, d, y);
      continue;
    }
#define TALL(c) case c: block(K, x, r0, c, n, NSTEP, N, q, gbytes, unpack, d, y); break;
#define WIDE(c) case c: { for (int j = 0; j < NSTEP; j += NWIDE) \
                          block(K, x, r0, c, n + j, NWIDE, N, q, gbytes, unpack, d, y); } break;
    switch (mb) { TALL(1) TALL(2) TALL(3) TALL(4) WIDE(5) WIDE(6) WIDE(7) WIDE(8) }
#undef TALL
#undef WIDE
  }
}

void int8_mm(int M, int N, int K, const float* x, const int8_t* q, const uint16_t* d, float* y) {
  int G = K / 32;
  if (M > 1) {
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n += NSTEP) rows_times(n, M, N, K, x, (const uint8_t*)q, 32, (unpack_fn)int8_unpack, d, y);
    return;
  }
  #pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n++)
    y[n] = row_one(K, x, (const uint8_t*)q + (int64_t)n * K, 32, (unpack_fn)int8_unpack, d + (int64_t)n * G);
}

/* Rows of W as float32 (out[N, K]): many activation rows (a prefill chunk) are multiplied
   by a float GEMM over this copy instead (its cost is paid once for the chunk). */
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

/* Float32 weights (out[N, K], K a multiple of 32) through the same blocks, a group's values
   loaded as they are (one activation row: f32_row): fused_decode.c's step over float32
   weights and packed.cpu_f32_linear's 1-16 rows, where MKL's small-M GEMM read the LM
   head at half this rate and its one-row path at 0.4x; past 16 rows a GEMM's blocking wins
   (packed.gemm: oneDNN; docs/BENCHMARKS.md 22-23). */
static inline void f32_unpack(const uint8_t* qb, VEC w[NV]) {
  for (int v = 0; v < NV; v++) w[v] = VLOAD((const float*)qb + v * LANES);
}

/* One activation row: each weight row read front to back into two accumulators, one
   stream per thread. The blocks' four interleaved rows read 0.8x as fast at batch 1
   (SmolLM2's matrices, docs/BENCHMARKS.md 23): the hardware prefetchers follow one
   stream better than four short ones (a row is 2-6 KB). */
static inline float f32_row(int K, const float* x, const float* w) {
  VEC a0 = VZERO, a1 = VZERO;
  for (int k = 0; k < K; k += 2 * LANES) {  /* K: a multiple of 32 = 2 vectors at least */
    a0 = VFMA(VLOAD(w + k), VLOAD(x + k), a0);
    a1 = VFMA(VLOAD(w + k + LANES), VLOAD(x + k + LANES), a1);
  }
  return hsum(VADD(a0, a1));
}

void f32_mm(int M, int N, int K, const float* x, const float* w, float* y) {
  if (M == 1) {
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) y[n] = f32_row(K, x, w + (int64_t)n * K);
    return;
  }
  #pragma omp parallel for schedule(static)
  for (int n = 0; n < N; n += NSTEP) rows_times(n, M, N, K, x, (const uint8_t*)w, 128, (unpack_fn)f32_unpack, 0, y);
}
