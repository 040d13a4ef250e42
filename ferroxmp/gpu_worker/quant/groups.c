/* Float32 weights in panels times activation rows (f32_panel_mm, below): the matmuls of
   fused_decode.c's step over float32 weights and of packed.PackedF32 at any row count.
   Also the float lanes (VEC, VFMA, hsum...) that int4x16.c and fused_decode.c build on.
   int4 and int8 weights have their own layout and kernel (int4x16.c), included after
   this file. Built with the machine's compiler at first use (native.py). */
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
   then the two (GCC's _mm512_reduce_add_ps, written out: the same order whatever the
   compiler). */
static inline float hsum(__m512 v) {
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_shuffle_ps(q, q, 0x4E));
  return _mm_cvtss_f32(q) + _mm_cvtss_f32(_mm_shuffle_ps(q, q, 0x55));
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

/* Float32 weights in panels (f32_panel_mm): y[M, N] = x[M, K] @ W^T with W stored as
   ceil(N / 32) panels of [K][32] (packed.PackedF32: output rows n..n+31 of W, k-major,
   the last panel zero-padded). For each k a panel row is one broadcast activation times
   32 outputs (2 or 4 vectors), so the products are outer products with no horizontal sums:
   a tile of up to TILE_ROWS activation rows keeps 2 x 12 (AVX-512) or 4 x 3 (AVX2)
   accumulators in registers and loads each panel row once for all of them. On SmolLM2's
   matrices at 8-16 rows 1.3-1.7x the dot-product kernel this replaced (f32_mm over
   [N][K] rows) and oneDNN's GEMM; past 32 rows level with oneDNN (docs/BENCHMARKS.md 31).
   One or two rows read several panels at once (panel_streams).

   Each output is one chain of fused multiply-adds over k = 0..K-1, in every path (any
   row count, any tile, AVX2 or AVX-512): a row's result does not depend on the other rows
   of the call, or on how many there are, to the bit. */
#define PANEL 32
#define PV (PANEL / LANES)  /* vectors a panel row */
#ifdef __AVX512F__
#define TILE_ROWS 12
#else
#ifndef TILE_ROWS
#define TILE_ROWS 3
#endif
#endif
/* Each panel row also prefetched non-temporally PANEL_AHEAD bytes on, by the first tile
   of a panel only (the one that reads it from memory): a plain stream sweeps the caches
   of the step's other data and code (as in int4x16.c). */
#ifndef PANEL_AHEAD
#define PANEL_AHEAD 256
#endif
#ifndef PANEL_HINT
#define PANEL_HINT _MM_HINT_NTA
#endif

/* Rows of a tile times panel rows k0..k1-1, the accumulators carried in `mem` between
   calls (zeroed at k0 = 0): the same chain of fused multiply-adds as one call over all k. */
static inline __attribute__((always_inline)) void panel_tile(int rows, int k0, int k1, int K, const float* x,
    const float* wp, VEC* mem, int first) {
  VEC acc[TILE_ROWS][PV];
  for (int i = 0; i < rows; i++)
    for (int v = 0; v < PV; v++) acc[i][v] = k0 == 0 ? VZERO : mem[i * PV + v];
  for (int k = k0; k < k1; k++) {
    const float* wk = wp + (int64_t)k * PANEL;
    if (first)
      for (int b = 0; b < PANEL * (int)sizeof(float); b += 64) _mm_prefetch((const char*)wk + PANEL_AHEAD + b, PANEL_HINT);
    VEC w[PV];
    for (int v = 0; v < PV; v++) w[v] = VLOAD(wk + v * LANES);
    for (int i = 0; i < rows; i++) {
      VEC xv = VSET1(x[(int64_t)i * K + k]);
      for (int v = 0; v < PV; v++) acc[i][v] = VFMA(w[v], xv, acc[i][v]);
    }
  }
  for (int i = 0; i < rows; i++)
    for (int v = 0; v < PV; v++) mem[i * PV + v] = acc[i][v];
}

/* Panel rows a block: every tile of a call's rows takes a block of KBLOCK panel rows in
   turn (the first tile reads it from memory, the others from L1), so the weights' read is
   spread over all the rows' multiplies instead of falling on the first tile alone while
   the others compute from cache with the memory idle (up to 16 rows: a decode step's
   products alone 5-8% less time at 4-16 rows; docs/BENCHMARKS.md 34). KBLOCK >= K: tile after tile. */
#ifndef KBLOCK
#define KBLOCK 32
#endif
#define MAX_ITEM_ROWS 48  /* PANEL_ITEM_ROWS: the most rows panel_rows is given */

/* Rows 0..M-1 (M <= MAX_ITEM_ROWS) of x times one panel, in tiles of TILE_ROWS rows. A
   constant `rows` per call keeps the accumulators in registers. */
static inline void panel_rows(int M, int K, const float* x, const float* wp, float* y, int N, int valid) {
  VEC mem[MAX_ITEM_ROWS * PV];
  const int full = M - M % TILE_ROWS, tail = M % TILE_ROWS;
  const int kb = M <= 16 ? KBLOCK : K;  /* past 16 rows (a prefill's items) blocks measured 0-6% slower */
  for (int k0 = 0; k0 < K; k0 += kb) {
    const int k1 = k0 + kb < K ? k0 + kb : K;
    for (int r = 0; r < full; r += TILE_ROWS)
      panel_tile(TILE_ROWS, k0, k1, K, x + (int64_t)r * K, wp, mem + r * PV, r == 0);
    const float* xr = x + (int64_t)full * K;
    VEC* mr = mem + full * PV;
    switch (tail) {
#define TAIL(c) case c: panel_tile(c, k0, k1, K, xr, wp, mr, full == 0); break;
      TAIL(1) TAIL(2)
#ifdef __AVX512F__
      TAIL(3) TAIL(4) TAIL(5) TAIL(6) TAIL(7) TAIL(8) TAIL(9) TAIL(10) TAIL(11)
#endif
#undef TAIL
    }
  }
  for (int i = 0; i < M; i++) {
    if (valid == PANEL) {
      for (int v = 0; v < PV; v++) VSTORE(y + (int64_t)i * N + v * LANES, mem[i * PV + v]);
    } else {  /* the last panel of an N that 32 does not divide */
      float out[PANEL];
      for (int v = 0; v < PV; v++) VSTORE(out + v * LANES, mem[i * PV + v]);
      for (int j = 0; j < valid; j++) y[(int64_t)i * N + j] = out[j];
    }
  }
}

/* Rows of activations per work item past 16 rows, and per pass over all the panels: the
   pass's activations (192 x K floats) stay in L2 while every panel streams through once. */
#define PANEL_ITEM_ROWS 48
#define PANEL_PASS_ROWS 192

/* One activation row times PANEL_STREAMS adjacent panels at once (two rows: STREAMS2),
   panel p0 onwards: each thread keeps that many streams of the weights in flight instead
   of one. One stream a thread left this box's memory (AMD EPYC, AVX2, 2 threads) idle
   between its misses: float32 SmolLM2's one-row step 1.19-1.23x faster with 3 streams,
   1.13-1.16x with 2, 3 better than 4 (spilled accumulators); two rows 1.08-1.12x with 2
   (docs/BENCHMARKS.md 33). Each output is the same chain of fused multiply-adds as
   panel_tile's: the same bits. */
#ifndef PANEL_STREAMS
#define PANEL_STREAMS 3
#endif
#ifndef STREAMS2
#define STREAMS2 2
#endif
#define MAX_STREAMS (PANEL_STREAMS > STREAMS2 ? PANEL_STREAMS : STREAMS2)
static inline __attribute__((always_inline)) void panel_streams(int rows, int ns, int K, const float* x,
    const float* w0, int64_t stride, float* y, int N, int p0) {
  VEC acc[2][MAX_STREAMS][PV];
  for (int i = 0; i < rows; i++)
    for (int s = 0; s < ns; s++)
      for (int v = 0; v < PV; v++) acc[i][s][v] = VZERO;
  for (int k = 0; k < K; k++) {
    VEC xv[2];
    for (int i = 0; i < rows; i++) xv[i] = VSET1(x[(int64_t)i * K + k]);
    for (int s = 0; s < ns; s++) {
      const float* wk = w0 + s * stride + (int64_t)k * PANEL;
      for (int b = 0; b < PANEL * (int)sizeof(float); b += 64) _mm_prefetch((const char*)wk + PANEL_AHEAD + b, PANEL_HINT);
      for (int v = 0; v < PV; v++) {
        VEC w = VLOAD(wk + v * LANES);
        for (int i = 0; i < rows; i++) acc[i][s][v] = VFMA(w, xv[i], acc[i][s][v]);
      }
    }
  }
  for (int i = 0; i < rows; i++)
    for (int s = 0; s < ns; s++) {
      float out[PANEL];
      const int valid = N - (p0 + s) * PANEL < PANEL ? N - (p0 + s) * PANEL : PANEL;
      for (int v = 0; v < PV; v++) VSTORE(out + v * LANES, acc[i][s][v]);
      for (int j = 0; j < valid; j++) y[(int64_t)i * N + s * PANEL + j] = out[j];
    }
}

/* The product shared by the threads of the enclosing parallel region, each calling it
   (orphaned worksharing: outside a region the caller computes it alone); the region's
   threads meet at its end. Up to 16 rows (a decode step: its time is the weights' read)
   each panel is one thread's, read once; past that, work items of a panel times up to
   PANEL_ITEM_ROWS rows. fused_decode.c's step runs in one region for all its layers. */
static inline void f32_panel_mm_team(int M, int N, int K, const float* x, const float* wp, float* y) {
  int NP = (N + PANEL - 1) / PANEL;
  const int64_t stride = (int64_t)K * PANEL;
  if (M <= 2) {  /* items of `ns` panels; the last item's panels (NP not a multiple) one by one */
    const int ns = M == 1 ? PANEL_STREAMS : STREAMS2;
    #pragma omp for schedule(static)
    for (int q = 0; q < (NP + ns - 1) / ns; q++) {
      const int p0 = q * ns;
      if (p0 + ns <= NP) {
        if (M == 1) panel_streams(1, PANEL_STREAMS, K, x, wp + p0 * stride, stride, y + p0 * PANEL, N, p0);
        else panel_streams(2, STREAMS2, K, x, wp + p0 * stride, stride, y + p0 * PANEL, N, p0);
        continue;
      }
      for (int p = p0; p < NP; p++)
        panel_rows(M, K, x, wp + p * stride, y + p * PANEL, N, N - p * PANEL < PANEL ? N - p * PANEL : PANEL);
    }
    return;
  }
  if (M <= 16) {
    #pragma omp for schedule(static)
    for (int p = 0; p < NP; p++)
      panel_rows(M, K, x, wp + p * stride, y + p * PANEL, N, N - p * PANEL < PANEL ? N - p * PANEL : PANEL);
    return;
  }
  for (int r0 = 0; r0 < M; r0 += PANEL_PASS_ROWS) {
    int rows = M - r0 < PANEL_PASS_ROWS ? M - r0 : PANEL_PASS_ROWS;
    int items = (rows + PANEL_ITEM_ROWS - 1) / PANEL_ITEM_ROWS;
    #pragma omp for schedule(static) collapse(2)
    for (int p = 0; p < NP; p++)
      for (int it = 0; it < items; it++) {
        int r = r0 + it * PANEL_ITEM_ROWS, m = r0 + rows - r < PANEL_ITEM_ROWS ? r0 + rows - r : PANEL_ITEM_ROWS;
        panel_rows(m, K, x + (int64_t)r * K, wp + p * stride, y + (int64_t)r * N + p * PANEL, N,
                   N - p * PANEL < PANEL ? N - p * PANEL : PANEL);
      }
  }
}

void f32_panel_mm(int M, int N, int K, const float* x, const float* wp, float* y) {
  #pragma omp parallel
  f32_panel_mm_team(M, N, K, x, wp, y);
}
