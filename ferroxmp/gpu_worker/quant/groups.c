/* Float32 weights times a few activation rows (f32_mm): the matmuls of fused_decode.c's
   step over float32 weights and packed.cpu_f32_linear's 1-16 rows, where MKL's small-M
   GEMM read the LM head at half this rate and its one-row path at 0.4x; past 16 rows a
   GEMM's blocking wins (packed.gemm: oneDNN; docs/BENCHMARKS.md 22-23). Also the float
   lanes (VEC, VFMA, hsum...) that int4x16.c and fused_decode.c build on. int4 and int8
   weights have their own layout and kernel (int4x16.c), included after this file.

   y[M, N] = x[M, K] @ W^T, K a multiple of 32: each output a dot product in float32
   lanes. The order of the sum depends on K and on the path (up to STREAM_ROWS
   activation rows, or more), never on the values of the other rows. Built with the machine's compiler at
   first use (native.py). */
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
/* The sum of v's lanes: lane j + lane j + 8, then those j + j + 4, then 0 + 2 and 1 + 3,
   then the two (GCC's _mm512_reduce_add_ps, written out so that hsum4 adds the same
   pairs in the same order whatever the compiler). */
static inline float hsum(__m512 v) {
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_shuffle_ps(q, q, 0x4E));
  return _mm_cvtss_f32(q) + _mm_cvtss_f32(_mm_shuffle_ps(q, q, 0x55));
}
/* out[0..4) = hsum of a, b, c, d, to the bit (the same pairs added in the same order), in
   ~14 ops instead of ~32: halves added across the four, then quarters, then each
   quarter's lanes. */
static inline void hsum4(__m512 a, __m512 b, __m512 c, __m512 d, float* out) {
  __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  __m512 v = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0x4E));
  v = _mm512_add_ps(v, _mm512_shuffle_ps(v, v, 0xB1));
  _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                                     0, 0, 0, 0), v)));
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
#endif
#define LANES (32 / NV)

/* Several activation rows (a batch of decode rows, a small chunk): output rows n .. n+nr-1
   for activation rows r0 .. r0+mb-1, each group of 32 weights loaded once per block and
   multiplied by every row of the block, each activation load serving the block's nr
   weight rows. A row's sum runs over the same values in the same order whatever the
   other rows hold. Called with constant nr and mb (rows_times), so that the accumulators
   stay in registers. */
#ifdef __AVX512F__
#define NSTEP 4  /* output rows per parallel step: a block of 4 x (up to 4) activation rows */
#define NWIDE 2  /* output rows per block of 5-8 activation rows (32 registers) */
#else
#define NSTEP 1  /* 16 registers: one output row per block */
#define NWIDE 1
#endif
#define MR 8
static inline __attribute__((always_inline)) void block(int K, const float* x, int r0, int mb, int n, int nr,
    int N, const float* w, float* y) {
  int G = K / 32;
  VEC acc[NSTEP][MR];
  for (int j = 0; j < nr; j++)
    for (int i = 0; i < mb; i++) acc[j][i] = VZERO;
  for (int g = 0; g < G; g++) {
    VEC wv[NSTEP][NV];
    for (int j = 0; j < nr; j++) {
      const float* wg = w + ((int64_t)(n + j) * G + g) * 32;
      /* the same group NSTEP rows on, both of its lines: the thread's next block (static
         schedule), fetched while this one computes; the hardware prefetchers lose four
         short interleaved rows (2-6 KB each): +20-27% read rate at 4-16 rows
         (docs/BENCHMARKS.md 23). */
      const char* pf = (const char*)(wg + (int64_t)NSTEP * G * 32);
      _mm_prefetch(pf, _MM_HINT_T0);
      _mm_prefetch(pf + 64, _MM_HINT_T0);
      for (int v = 0; v < NV; v++) wv[j][v] = VLOAD(wg + v * LANES);
    }
    for (int i = 0; i < mb; i++) {
      const float* xb = x + (int64_t)(r0 + i) * K + g * 32;
      for (int v = 0; v < NV; v++) {
        VEC xv = VLOAD(xb + v * LANES);
        for (int j = 0; j < nr; j++) acc[j][i] = VFMA(wv[j][v], xv, acc[j][i]);
      }
    }
  }
#ifdef __AVX512F__
  if ((nr * mb) % 4 == 0) {  /* four sums at a time (hsum4): ~3.5 ops a sum instead of ~8 */
    for (int k = 0; k < nr * mb; k += 4) {
      float s4[4];
      hsum4(acc[k / mb][k % mb], acc[(k + 1) / mb][(k + 1) % mb], acc[(k + 2) / mb][(k + 2) % mb],
            acc[(k + 3) / mb][(k + 3) % mb], s4);
      for (int e = 0; e < 4; e++) y[(int64_t)(r0 + (k + e) % mb) * N + n + (k + e) / mb] = s4[e];
    }
    return;
  }
#endif
  for (int j = 0; j < nr; j++)
    for (int i = 0; i < mb; i++) y[(int64_t)(r0 + i) * N + n + j] = hsum(acc[j][i]);
}

/* Every activation row times output rows n .. n+NSTEP-1. */
static inline __attribute__((always_inline)) void rows_times(int n, int M, int N, int K, const float* x,
    const float* w, float* y) {
  for (int r0 = 0; r0 < M; r0 += MR) {
    int mb = M - r0 < MR ? M - r0 : MR;
    if (N - n < NSTEP) {  /* the last output rows of an N that NSTEP does not divide */
      for (int j = n; j < N; j++) block(K, x, r0, mb, j, 1, N, w, y);
      continue;
    }
#define TALL(c) case c: block(K, x, r0, c, n, NSTEP, N, w, y); break;
#define WIDE(c) case c: { for (int j = 0; j < NSTEP; j += NWIDE) block(K, x, r0, c, n + j, NWIDE, N, w, y); } break;
    switch (mb) { TALL(1) TALL(2) TALL(3) TALL(4) WIDE(5) WIDE(6) WIDE(7) WIDE(8) }
#undef TALL
#undef WIDE
  }
}

/* Up to STREAM_ROWS activation rows: each weight row read front to back once, into two
   accumulators per activation row, the rows of a thread's share one stream through
   memory. The hardware prefetchers follow one stream best (a row is 2-6 KB): the blocks'
   four interleaved rows read 0.8x as fast at one row (SmolLM2's matrices,
   docs/BENCHMARKS.md 23), and at 2-6 rows this is 1.03-1.3x faster than them, past that
   their reuse of each activation load wins (section 26). A row's sum takes the same
   order here whatever the step's row count (1 .. STREAM_ROWS): a speculative verify of up
   to 5 drafts rounds as one-token steps do (a longer one within float rounding). */
#define STREAM_ROWS 6
/* Each line of the stream is also prefetched non-temporally (PREFETCHNTA) 320 bytes, five
   lines, before its load. What it changes is the rest of the step: a one-row float32 step
   reads ~520 MB once, and as plain loads those lines swept the caches, so that attention's
   code and K/V and the step's Python came back from DRAM at every layer and step (an
   attention work item took 19 us cold against 3 warm). One-row SmolLM2 step, alternated
   with the same step without: 9.4-9.6 vs 10.4-10.5 ms (-9%) while the box read fast,
   -5% while it read slowly; 128-256 bytes ahead gained less, 512 nothing, 1,024 lost
   (docs/BENCHMARKS.md 29). */
#ifndef NTA_AHEAD
#define NTA_AHEAD 320
#endif
static inline __attribute__((always_inline)) void stream_row(int K, const float* x, int mb, const float* w,
    float* y, int N) {
  VEC a0[STREAM_ROWS], a1[STREAM_ROWS];
  for (int i = 0; i < mb; i++) a0[i] = a1[i] = VZERO;
  for (int k = 0; k < K; k += 2 * LANES) {  /* K: a multiple of 32 = 2 vectors at least */
    for (int b = 0; b < 2 * LANES * (int)sizeof(float); b += 64)
      _mm_prefetch((const char*)(w + k) + NTA_AHEAD + b, _MM_HINT_NTA);
    VEC w0 = VLOAD(w + k), w1 = VLOAD(w + k + LANES);
    for (int i = 0; i < mb; i++) {
      a0[i] = VFMA(w0, VLOAD(x + (int64_t)i * K + k), a0[i]);
      a1[i] = VFMA(w1, VLOAD(x + (int64_t)i * K + k + LANES), a1[i]);
    }
  }
  int i = 0;
#ifdef __AVX512F__
  for (; i + 4 <= mb; i += 4) {  /* (hsum4, as the blocks) */
    float s4[4];
    hsum4(VADD(a0[i], a1[i]), VADD(a0[i + 1], a1[i + 1]), VADD(a0[i + 2], a1[i + 2]), VADD(a0[i + 3], a1[i + 3]), s4);
    for (int e = 0; e < 4; e++) y[(int64_t)(i + e) * N] = s4[e];
  }
#endif
  for (; i < mb; i++) y[(int64_t)i * N] = hsum(VADD(a0[i], a1[i]));
}

/* The product shared by the threads of the enclosing parallel region, each calling it
   (orphaned worksharing: outside a region the caller computes it alone); the region's
   threads meet at its end. fused_decode.c's step runs in one region for all its layers. */
static inline void f32_mm_team(int M, int N, int K, const float* x, const float* w, float* y) {
  if (M <= STREAM_ROWS) {
    #pragma omp for schedule(static)
    for (int n = 0; n < N; n++) {
#define ROWS(c) case c: stream_row(K, x, c, w + (int64_t)n * K, y + n, N); break;
      switch (M) { ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) }
#undef ROWS
    }
    return;
  }
  #pragma omp for schedule(static)
  for (int n = 0; n < N; n += NSTEP) rows_times(n, M, N, K, x, w, y);
}

void f32_mm(int M, int N, int K, const float* x, const float* w, float* y) {
  #pragma omp parallel
  f32_mm_team(M, N, K, x, w, y);
}
