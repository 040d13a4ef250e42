/* A step of up to 16 tokens (decode rows, a speculative verify's or a short prompt's
   chunk: each token one row at its own position) through every layer in one call, for a
   model whose linear weights are groups of 32 (int4/int8, int4x16.c) or float32, float32
   activations.

   Why: the eager step is ~600 small torch ops between the matmuls, each a few
   microseconds of dispatch, whatever the batch: on SmolLM2 int4 at batch 1 they cost about
   as much as the matmuls themselves (docs/BENCHMARKS.md 21), and in float32 they are what
   stands between the step and the bandwidth floor. Here the glue between the matmuls
   (RMSNorm, RoPE, q/k norms, the KV writes, attention over each row's pages, SiLU-mul,
   the residual adds) is a few loops over a few thousand floats per row, and the matmuls
   are int4x16.c's and groups.c's small-M kernels (OpenMP over output rows), every row of
   the step in one pass over each weight. Past 16 rows (FUSED_ROWS) a step's compute, not
   its glue, is its time, and it runs eagerly.

   Numerics follow models/llama.py in float32 (RMSNorm: x * rsqrt(mean(x^2) + eps), then
   the weight; RoPE: x * cos + rotate_half(x) * sin; softmax scale head_dim ** -0.5); sums
   run in another order than torch's, so results agree within float rounding, not to the
   bit (tests/test_fused_decode.py bounds the difference and compares greedy tokens). A
   row's sums do not depend on the other rows of the step (the kernels' blocks; float32
   panels round a row alike at any row count, groups.c).

   KV: row r's K/V go to the pool (layout "hnd": [layers][kv_heads][slots][head_dim];
   float32, or float16 under --kv-cache-dtype float16: store_kv) at `slot[r]`, and
   attention reads positions 0..pos[r] back from the row's pages there (the step's own
   K/V as stored: rounded, in a float16 pool, as attention/cpu.py reads them). The decode
   mirror is not touched: it serves the eager steps only, which refill it from the pool.
*/
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include "groups.c"
#include "int4x16.c"

typedef struct {
  const uint8_t* q; const uint16_t* d; const uint16_t* m;  /* int4x16.c's blocks: m int4, NULL int8; d NULL: float32 panels (groups.c) */
  const float* bias;  /* NULL: none */
  int n, k;
} Lin;

typedef struct {
  const float *in_norm, *post_norm, *q_norm, *k_norm;  /* q/k norm NULL: none */
  Lin qkv, o, gate_up, down;
} Layer;

typedef struct {
  int layers, heads, kv_heads, head_dim, hidden, inter;
  float eps;
  const Layer* layer;
  void *pool_k, *pool_v;  /* [layers][kv_heads][slots][head_dim], float32 or (kv_f16) float16 */
  int64_t pool_slots;
  int page_size;           /* slot = page * page_size + offset */
  int kv_f16;              /* --kv-cache-dtype float16 */
  const float* norm;       /* the final RMSNorm's weight */
  Lin head;                /* the LM head (n 0: one this file cannot multiply) */
  Lin embed;               /* the embedding table, rows looked up here (n 0: the caller embeds) */
} Model;

/* One head's K or V (n values) into the pool at element `at`. A float16 pool gets them
   rounded to nearest even (torch's conversion, which the eager path uses). */
static void store_kv(const Model* M, void* pool, int64_t at, float* x, int n) {
  if (!M->kv_f16) {
    memcpy((float*)pool + at, x, n * sizeof(float));
    return;
  }
  uint16_t* dst = (uint16_t*)pool + at;
  for (int i = 0; i < n; i++) dst[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}



/* y[R][n] = x[R][k] W^T (+ bias), shared by the threads of the enclosing parallel region
   (f32_panel_mm_team, x16_mm_team). xs: the int4/int8 kernel's scratch (int4x16_scratch bytes). */
static void lin_team(const Lin* w, int R, const float* x, float* y, float* xs) {
  if (!w->d) f32_panel_mm_team(R, w->n, w->k, x, (const float*)w->q, y);
  else x16_mm_team(!w->m, R, w->n, w->k, x, w->q, w->d, w->m, xs, y);
  if (w->bias) {
    #pragma omp for schedule(static)
    for (int r = 0; r < R; r++)
      for (int i = 0; i < w->n; i++) y[(int64_t)r * w->n + i] += w->bias[i];
  }
}

#ifdef __AVX512F__
#define VSUB _mm512_sub_ps
#define VMAX _mm512_max_ps
#define VROUND(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define VPOW2(y, n) _mm512_scalef_ps(y, n)
#define VDIV _mm512_div_ps
#define VABS _mm512_abs_ps
#define VPICK_GE0(x, a, b) _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, VZERO, _CMP_GE_OQ), b, a)
#else
#define VSUB _mm256_sub_ps
#define VMAX _mm256_max_ps
#define VROUND(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define VDIV _mm256_div_ps
#define VABS(x) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x)
#define VPICK_GE0(x, a, b) _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, VZERO, _CMP_GE_OQ))
#define VPOW2(y, n) _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32( \
    _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23)))
#endif
/* a . b in float lanes (a plain loop is one scalar chain: C may not reorder the sum). */
static inline float dot(const float* a, const float* b, int n) {
  VEC s0 = VZERO, s1 = VZERO;
  int i = 0;
  for (; i + 2 * LANES <= n; i += 2 * LANES) {
    s0 = VFMA(VLOAD(a + i), VLOAD(b + i), s0);
    s1 = VFMA(VLOAD(a + i + LANES), VLOAD(b + i + LANES), s1);
  }
  for (; i + LANES <= n; i += LANES) s0 = VFMA(VLOAD(a + i), VLOAD(b + i), s0);
  float s = hsum(VADD(s0, s1));
  for (; i < n; i++) s += a[i] * b[i];
  return s;
}

/* e^x for x <= 0, in float lanes: Cephes' expf (range reduction by ln 2 in two parts, a
   degree-5 polynomial; within 2 ulp of expf), so the softmax costs no scalar libm call
   per key. Below -87.3 the result is ~1e-38 instead of 0: nothing to a softmax sum. */
static inline VEC vexp(VEC x) {
  x = VMAX(x, VSET1(-87.3f));
  VEC n = VROUND(VMUL(x, VSET1(1.44269504088896341f)));
  x = VFMA(n, VSET1(-0.693359375f), x);
  x = VFMA(n, VSET1(2.12194440e-4f), x);
  VEC y = VSET1(1.9875691500e-4f);
  y = VFMA(y, x, VSET1(1.3981999507e-3f));
  y = VFMA(y, x, VSET1(8.3334519073e-3f));
  y = VFMA(y, x, VSET1(4.1665795894e-2f));
  y = VFMA(y, x, VSET1(1.6666665459e-1f));
  y = VFMA(y, x, VSET1(5.0000001201e-1f));
  y = VADD(VFMA(y, VMUL(x, x), x), VSET1(1.0f));
  return VPOW2(y, n);
}

/* max of p[0..n) in float lanes (a scalar loop is one chain of dependent maxss, ~3 cycles
   a score). */
static inline float max_of(const float* p, int n) {
  VEC m0 = VSET1(-INFINITY), m1 = m0;
  int t = 0;
  for (; t + 2 * LANES <= n; t += 2 * LANES) {
    m0 = VMAX(m0, VLOAD(p + t));
    m1 = VMAX(m1, VLOAD(p + t + LANES));
  }
  for (; t + LANES <= n; t += LANES) m0 = VMAX(m0, VLOAD(p + t));
  float lane[LANES], mx = -INFINITY;
  VSTORE(lane, VMAX(m0, m1));
  for (int i = 0; i < LANES; i++) mx = lane[i] > mx ? lane[i] : mx;
  for (; t < n; t++) mx = p[t] > mx ? p[t] : mx;
  return mx;
}

/* p[0..n) = e^(p - mx), returning their sum. */
static inline float exp_sum(float* p, int n, float mx) {
  VEC s = VZERO, m = VSET1(mx);
  int t = 0;
  for (; t + LANES <= n; t += LANES) {
    VEC e = vexp(VSUB(VLOAD(p + t), m));
    VSTORE(p + t, e);
    s = VADD(s, e);
  }
  float sum = hsum(s);
  for (; t < n; t++) { p[t] = expf(p[t] - mx); sum += p[t]; }
  return sum;
}

/* a[i] = silu(g[i]) * u[i] = g / (1 + e^-g) * u, in float lanes: e = e^-|g| (vexp's range),
   then sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below. A scalar expf per value
   took 89 us for 16 rows of SmolLM2's 1536 (2.7 ms of a ~50 ms step over 30 layers);
   these lanes take 8 us. */
static inline void silu_mul(const float* g, const float* u, float* a, int n) {
  int i = 0;
  for (; i + LANES <= n; i += LANES) {
    VEC x = VLOAD(g + i), e = vexp(VSUB(VZERO, VABS(x))), one = VSET1(1.0f);
    VEC s = VDIV(VPICK_GE0(x, one, e), VADD(one, e));
    VSTORE(a + i, VMUL(VMUL(x, s), VLOAD(u + i)));
  }
  for (; i < n; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

#ifdef __AVX512F__
#define VLOADH(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p)))
#else
#define VLOADH(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p)))
#endif
/* q . (the pool's n values at element `at`), float32 or float16 widened. */
static inline float dot_kv(const Model* M, const float* q, const void* pool, int64_t at, int n) {
  if (!M->kv_f16) return dot(q, (const float*)pool + at, n);
  const uint16_t* k = (const uint16_t*)pool + at;
  VEC s = VZERO;
  int i = 0;
  for (; i + LANES <= n; i += LANES) s = VFMA(VLOAD(q + i), VLOADH(k + i), s);
  float r = hsum(s);
  for (; i < n; i++) r += q[i] * _cvtsh_ss(k[i]);
  return r;
}

/* o += w * (the pool's n values at element `at`). */
static inline void axpy_kv(const Model* M, float* o, float w, const void* pool, int64_t at, int n) {
  VEC wv = VSET1(w);
  int i = 0;
  if (M->kv_f16) {
    const uint16_t* v = (const uint16_t*)pool + at;
    for (; i + LANES <= n; i += LANES) VSTORE(o + i, VFMA(wv, VLOADH(v + i), VLOAD(o + i)));
    for (; i < n; i++) o[i] += w * _cvtsh_ss(v[i]);
  } else {
    const float* v = (const float*)pool + at;
    for (; i + LANES <= n; i += LANES) VSTORE(o + i, VFMA(wv, VLOAD(v + i), VLOAD(o + i)));
    for (; i < n; i++) o[i] += w * v[i];
  }
}
static void rms(const float* x, const float* w, float* out, int n, float eps) {
  float s = dot(x, x, n);
  float r = 1.0f / sqrtf(s / n + eps);
  for (int i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

static void rope(float* x, const float* cos, const float* sin, int d) {
  int half = d / 2;
  for (int i = 0; i < half; i++) {
    float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

/* The step's scratch for R rows whose longest context is `span` positions: each row's
   activations, its attention weights, and the int4 kernel's rounded activations. */
typedef struct { float *x, *qkv, *o, *gu, *a, *y, *p, *xs; } Scratch;

/* Lays S out from `base` (NULL: only sizes it) and returns its size in floats: the one
   place that knows the layout, for fused_decode_scratch and fused_decode alike. */
static int64_t carve(const Model* M, int R, int64_t span, float* base, Scratch* S) {
  int64_t E = M->hidden, I = M->inter, HD = (int64_t)M->heads * M->head_dim;
  int64_t QKV = HD + 2 * (int64_t)M->kv_heads * M->head_dim, widest = E > I ? E : I;
  int64_t sizes[8] = {R * E, R * QKV, R * HD, R * 2 * I, R * I, R * E, R * M->heads * span,
                      int4x16_scratch(R, widest > HD ? widest : HD) / (int64_t)sizeof(float) + 1};
  float** parts[8] = {&S->x, &S->qkv, &S->o, &S->gu, &S->a, &S->y, &S->p, &S->xs};
  int64_t at = 0;
  for (int i = 0; i < 8; i++) {
    *parts[i] = base ? base + at : NULL;
    at += sizes[i];
  }
  return at;
}

/* Attention. A work item is a set of queries that read the same keys: one row's query
   head (a row alone in its pages), or up to ATT_MAXQ queries of rows sharing their pages
   (the tokens of one chunk: a speculative verify, a short prompt; each at its own
   position) times the query heads of one KV head. Its K and V rows are widened once per
   key for all its queries, and the weighted sum of V runs in registers (ATT_ACC
   accumulators): per key and query, a few FMAs instead of a reload and a store of the
   output (whose store-to-load chain set the pace before) and a horizontal sum. Scores
   go to p [R][H][span] (exp'd in place), as before. */
#define ATT_MAXQ 48
#define ATT_LANES_MIN 6  /* from this many queries, scores with queries in lanes (no horizontal sums) */
#ifdef __AVX512F__
#define ATT_ACC 16
#define ATT_ACC_WIDE 24  /* head sizes of up to 4 vectors: 24 sums + 4 of V + a weight in 32 registers */
#else
#define ATT_ACC 8
#define ATT_ACC_WIDE 8
#endif

/* Key or value t of a KV head (D values at element `at`) as float32: the pool's own row
   (float32), or widened into tmp (float16). */
static inline const float* kv_row(const Model* M, const void* pool, int64_t at, int D, float* tmp) {
  if (!M->kv_f16) return (const float*)pool + at;
  const uint16_t* h = (const uint16_t*)pool + at;
  int i = 0;
  for (; i + LANES <= D; i += LANES) VSTORE(tmp + i, VLOADH(h + i));
  for (; i < D; i++) tmp[i] = _cvtsh_ss(h[i]);
  return tmp;
}

/* Element offset of the page that holds position t0 (a multiple of page_size) of a KV
   head in `pool`, for a walk over n positions; it prefetches the walk's page ATT_AHEAD
   on (all of them from the first). A row's pages lie anywhere in the pool and the
   hardware prefetchers start cold at each one; with a step's weights streamed through
   the caches in between, the K/V came from DRAM a page at a time, latency-bound
   (tools/bench_attention.py, float16 K/V, 30 layers: one row at 1,000 positions 8.0-9.6
   -> 5.2-5.7 ms, 16 rows at 400 23.7-27.8 -> 15.7-18.7 ms; docs/BENCHMARKS.md 26). Into
   L2: into L1 it cost float32's 16 rows 5-10%. A walk over the keys also fetches the same
   page of the values, which the weighted sum reads next (16 rows at 400: 10-13% less
   time; docs/BENCHMARKS.md 27), so a walk over the values prefetches nothing: its pages
   are in L2 already, and its own prefetches (under AVX2 one walk a query, 3 a KV head)
   only cost instructions (1-4% of a step in 5 of 5 cases; docs/BENCHMARKS.md 34). */
#define ATT_AHEAD 2
static inline int64_t page_walk(const Model* M, const void* pool, int64_t head, const int64_t* pg, int t0, int lo,
                                int n) {
  const int ps = M->page_size, D = M->head_dim, page = t0 / ps, last = (n - 1) / ps;
  if (pool == M->pool_v) return head + pg[page] * ps * D;  /* prefetched by the walk over the keys */
  const int64_t bytes = (int64_t)ps * D * (M->kv_f16 ? 2 : 4);
  for (int i = t0 != lo ? page + ATT_AHEAD : page + 1; i <= page + ATT_AHEAD && i <= last; i++) {
    const char* a = (const char*)pool + (head + pg[i] * ps * D) * (M->kv_f16 ? 2 : 4);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(a + b, _MM_HINT_T1);
  }
  if (pool == M->pool_k) {  /* the V walk that follows the scores: its page, into L2 now */
    const char* a = (const char*)M->pool_v + (head + pg[page] * ps * D) * (M->kv_f16 ? 2 : 4);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(a + b, _MM_HINT_T1);
  }
  return head + pg[page] * ps * D;
}

/* An item's queries over the keys of one chunk, positions lo .. hi - 1 (query i: up to
   n[i] - 1); st[i]: where its chunk's softmax max and sum go (NULL: its only chunk, o[i]
   is the output itself). */
typedef struct {
  int nq, lo, hi;
  float* p[ATT_MAXQ]; const float* q[ATT_MAXQ]; float* o[ATT_MAXQ]; float* st[ATT_MAXQ]; int n[ATT_MAXQ];
} Queries;

/* The last key + 1 query i of Q reads in its chunk, and any of them. */
static inline int q_stop(const Queries* Q, int i) { return Q->n[i] < Q->hi ? Q->n[i] : Q->hi; }
static inline int q_end(const Queries* Q) {
  int e = 0;
  for (int i = 0; i < Q->nq; i++) e = q_stop(Q, i) > e ? q_stop(Q, i) : e;
  return e;
}

/* o_i = sum_t p_i[t] V[t] / inv_i for queries i0 .. i0 + GQ of Q (fewer at the end), HV
   vectors a head: both constants at each call, so acc stays in registers. */
static inline __attribute__((always_inline)) void att_pv(int HV, int GQ, const Model* M, const Queries* Q, int i0,
    const float* inv, int64_t head, const int64_t* pg) {
  const int D = M->head_dim, ps = M->page_size, g_n = Q->nq - i0 < GQ ? Q->nq - i0 : GQ;
  VEC acc[ATT_ACC_WIDE];
  for (int i = 0; i < GQ * HV; i++) acc[i] = VZERO;
  int nmax = 0;
  for (int g = 0; g < g_n; g++) nmax = q_stop(Q, i0 + g) > nmax ? q_stop(Q, i0 + g) : nmax;
  for (int t0 = Q->lo; t0 < nmax; t0 += ps) {
    const int64_t at = page_walk(M, M->pool_v, head, pg, t0, Q->lo, nmax);
    for (int t = t0; t < nmax && t < t0 + ps; t++) {
      const int64_t vat = at + (int64_t)(t - t0) * D;
      VEC vv[8];
      if (M->kv_f16)
        for (int k = 0; k < HV; k++) vv[k] = VLOADH((const uint16_t*)M->pool_v + vat + k * LANES);
      else
        for (int k = 0; k < HV; k++) vv[k] = VLOAD((const float*)M->pool_v + vat + k * LANES);
      for (int g = 0; g < GQ; g++)
        if (g < g_n && t < Q->n[i0 + g]) {
          const VEC w = VSET1(Q->p[i0 + g][t]);
          for (int k = 0; k < HV; k++) acc[g * HV + k] = VFMA(w, vv[k], acc[g * HV + k]);
        }
    }
  }
  for (int g = 0; g < g_n; g++)
    for (int k = 0; k < HV; k++) VSTORE(Q->o[i0 + g] + k * LANES, VMUL(acc[g * HV + k], VSET1(inv[g])));
}

/* Scores of every query of Q against keys 0 .. n_i - 1, with the queries in lanes: per
   key, D broadcast FMAs for LANES queries at once (qt [D][nqp]: the queries transposed,
   scaled). */
static void att_scores_lanes(const Model* M, const Queries* Q, int64_t head, const int64_t* pg, float scale,
                             float* qt, float* tmp) {
  const int D = M->head_dim, ps = M->page_size, nqp = (Q->nq + LANES - 1) / LANES * LANES;
  for (int i = 0; i < nqp; i++)
    for (int d = 0; d < D; d++) qt[d * nqp + i] = i < Q->nq ? Q->q[i][d] * scale : 0.0f;
  const int nmax = q_end(Q);
  float lane[LANES];
  for (int t0 = Q->lo; t0 < nmax; t0 += ps) {
    const int64_t at = page_walk(M, M->pool_k, head, pg, t0, Q->lo, nmax);
    for (int t = t0; t < nmax && t < t0 + ps; t++) {
      const float* k = kv_row(M, M->pool_k, at + (int64_t)(t - t0) * D, D, tmp);
      for (int b = 0; b < nqp; b += LANES) {
        VEC a0 = VZERO, a1 = VZERO, a2 = VZERO, a3 = VZERO;  /* four chains: FMA latency */
        int d = 0;
        for (; d + 4 <= D; d += 4) {
          a0 = VFMA(VSET1(k[d]), VLOAD(qt + d * nqp + b), a0);
          a1 = VFMA(VSET1(k[d + 1]), VLOAD(qt + (d + 1) * nqp + b), a1);
          a2 = VFMA(VSET1(k[d + 2]), VLOAD(qt + (d + 2) * nqp + b), a2);
          a3 = VFMA(VSET1(k[d + 3]), VLOAD(qt + (d + 3) * nqp + b), a3);
        }
        for (; d < D; d++) a0 = VFMA(VSET1(k[d]), VLOAD(qt + d * nqp + b), a0);
        VSTORE(lane, VADD(VADD(a0, a1), VADD(a2, a3)));
        for (int i = b; i < b + LANES && i < Q->nq; i++)
          if (t < Q->n[i]) Q->p[i][t] = lane[i - b];
      }
    }
  }
}

#ifdef __AVX512F__
/* 8 vectors -> their 8 horizontal sums, in the order of `a` (a0 .. a7), scaled, to out:
   the lane tree of _mm512_reduce_add_ps (i + i+8, then i + i+4, i + i+2, i + i+1) for 8
   vectors at once, ~2.6 instructions a sum instead of ~8. */
static inline void hsum8(const __m512* a, float scale, float* out) {
  static const int pair[4][2] = {{0, 2}, {4, 6}, {1, 3}, {5, 7}};
  __m512 b[4];
  for (int i = 0; i < 4; i++) {  /* lanes 0-7 key pair[i][0], 8-15 key pair[i][1]: 8 partial sums each */
    const __m512 x = a[pair[i][0]], y = a[pair[i][1]];
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xee));
  }
  /* 128-bit blocks of 4 partial sums: c0 keys 0, 2, 4, 6; c1 keys 1, 3, 5, 7 */
  __m512 c[2];
  for (int i = 0; i < 2; i++)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
  /* block j: key 2j in lanes 0-1, key 2j + 1 in lanes 2-3 (2 partial sums each), then summed into lanes 0, 2 */
  __m512 e = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x44), _mm512_shuffle_ps(c[0], c[1], 0xee));
  e = _mm512_add_ps(e, _mm512_permute_ps(e, 0xb1));
  _mm256_storeu_ps(out, _mm256_mul_ps(_mm512_castps512_ps256(_mm512_maskz_compress_ps(0x5555, e)),
                                      _mm256_set1_ps(scale)));
}

/* Scores of queries i0 .. i0 + NQ of Q against keys t .. t + 7 (one page): each key
   widened once for all NQ, 8 accumulators a query. */
static inline __attribute__((always_inline)) void att_scores8(int NQ, const Model* M, const Queries* Q, int i0,
                                                               int64_t at, int t, float scale) {
  const int D = M->head_dim;
  __m512 acc[3][8];
  for (int i = 0; i < NQ; i++)
    for (int j = 0; j < 8; j++) acc[i][j] = _mm512_setzero_ps();
  for (int c = 0; c < D; c += 16)
    for (int j = 0; j < 8; j++) {
      const int64_t e = at + (int64_t)j * D + c;
      const __m512 k = M->kv_f16 ? VLOADH((const uint16_t*)M->pool_k + e) : VLOAD((const float*)M->pool_k + e);
      for (int i = 0; i < NQ; i++) acc[i][j] = _mm512_fmadd_ps(VLOAD(Q->q[i0 + i] + c), k, acc[i][j]);
    }
  for (int i = 0; i < NQ; i++) hsum8(acc[i], scale, Q->p[i0 + i] + t);
}
#endif

/* Scores of fewer than ATT_LANES_MIN queries: one walk over the keys, each key for every
   query while it is in L1; under AVX-512 8 keys at a time where every query reads all 8
   (a row's own query heads read the same keys). */
static void att_scores_few(const Model* M, const Queries* Q, int64_t head, const int64_t* pg, float scale) {
  const int D = M->head_dim, ps = M->page_size, nmax = q_end(Q);
  int all = nmax;  /* keys every query reads */
  for (int i = 0; i < Q->nq; i++) all = q_stop(Q, i) < all ? q_stop(Q, i) : all;
  for (int t0 = Q->lo; t0 < nmax; t0 += ps) {
    const int64_t at = page_walk(M, M->pool_k, head, pg, t0, Q->lo, nmax);
    int t = t0;
#ifdef __AVX512F__
    for (; D % 16 == 0 && t + 8 <= all && t + 8 <= t0 + ps; t += 8)
      for (int i0 = 0; i0 < Q->nq; i0 += 3) {
        const int64_t kat = at + (int64_t)(t - t0) * D;
        const int nq = Q->nq - i0 < 3 ? Q->nq - i0 : 3;
        if (nq == 3) att_scores8(3, M, Q, i0, kat, t, scale);
        else if (nq == 2) att_scores8(2, M, Q, i0, kat, t, scale);
        else att_scores8(1, M, Q, i0, kat, t, scale);
      }
#endif
    for (; t < nmax && t < t0 + ps; t++)
      for (int i = 0; i < Q->nq; i++)
        if (t < Q->n[i]) Q->p[i][t] = dot_kv(M, Q->q[i], M->pool_k, at + (int64_t)(t - t0) * D, D) * scale;
  }
}

/* One work item: scores, softmax, weighted V, for the queries of Q (all of KV head j). */
static void att_item(const Model* M, int l, int j, const Queries* Q, const int64_t* pg, float* work) {
  const int D = M->head_dim, ps = M->page_size;
  const float scale = 1.0f / sqrtf((float)D);
  const int64_t head = (int64_t)l * M->kv_heads * M->pool_slots * D + (int64_t)j * M->pool_slots * D;
  float* tmp = work;           /* a widened K/V row: D floats */
  float* qt = work + D;        /* D * ATT_MAXQ (rounded up to lanes) */
  if (Q->nq >= ATT_LANES_MIN) att_scores_lanes(M, Q, head, pg, scale, qt, tmp);
  else att_scores_few(M, Q, head, pg, scale);
  float inv[ATT_MAXQ];
  for (int i = 0; i < Q->nq; i++) {
    const int e = q_stop(Q, i);
    const float mx = max_of(Q->p[i] + Q->lo, e - Q->lo);
    const float sum = exp_sum(Q->p[i] + Q->lo, e - Q->lo, mx);
    inv[i] = 1.0f / sum;
    if (Q->st[i]) Q->st[i][0] = mx, Q->st[i][1] = sum;
  }
  const int HV = D / LANES;
  if (D % LANES == 0 && (HV == 2 || HV == 4 || HV == 8) && HV <= ATT_ACC) {
    for (int i0 = 0; i0 < Q->nq; i0 += (HV <= 4 ? ATT_ACC_WIDE : ATT_ACC) / HV) {
      if (HV == 2) att_pv(2, ATT_ACC_WIDE / 2, M, Q, i0, inv + i0, head, pg);
      else if (HV == 4) att_pv(4, ATT_ACC_WIDE / 4, M, Q, i0, inv + i0, head, pg);
      else att_pv(8, ATT_ACC / 8, M, Q, i0, inv + i0, head, pg);
    }
    return;
  }
  for (int i = 0; i < Q->nq; i++) {  /* another head size: the output in memory */
    const int e = q_stop(Q, i);
    for (int d = 0; d < D; d++) Q->o[i][d] = 0;
    for (int t0 = Q->lo; t0 < e; t0 += ps) {
      const int64_t at = page_walk(M, M->pool_v, head, pg, t0, Q->lo, e);
      for (int t = t0; t < e && t < t0 + ps; t++)
        axpy_kv(M, Q->o[i], Q->p[i][t] * inv[i], M->pool_v, at + (int64_t)(t - t0) * D, D);
    }
  }
}

/* Attention of R rows at layer l: row r's H query heads (q + r * q_stride, H x D) over
   its KV head's positions 0..pos[r], read from the row's pages in the pool (a page of
   one head: page_size contiguous positions); o [R][H][D]; p [R][H][span] scratch for the
   scores. Rows with the same page_at are one sequence's tokens (each at its own
   position). Work items in parallel once the contexts make it worth a fork.

   Chunks: the keys of an item of fewer than ATT_LANES_MIN queries (a decoding row's
   query heads of one KV head) are taken ATT_CHUNK positions at a time (whole pages), each
   chunk its own item with its own softmax, the chunks' outputs joined by their maxima
   and sums (merge_chunks). Why: a row alone has one item per KV head, and 3 KV heads on
   2 threads left one thread idle a third of the attention (tools/bench_attention.py, one
   row at 1,000 positions: 3.5-3.8 -> 3.2 ms; docs/BENCHMARKS.md 27). The chunks are a
   function of the position only, never of the step's other rows: a decoding row's sums
   are the same alone or in a batch. A sequence's tokens of 6+ queries an item (a
   verify) stay whole: they have items enough, and chunking them measured 5-10% slower. */
#ifndef ATT_CHUNK
#define ATT_CHUNK 512
#endif

static inline int chunk_of(const Model* M) {
  const int ps = M->page_size;
  return ATT_CHUNK > ps ? ATT_CHUNK / ps * ps : ps;
}

/* o = the chunks' outputs (each normalized by its own sum) weighted by sum * e^(max - max
   of all): one softmax over all the keys. */
static void merge_chunks(int C, int D, const float* co, const float* st, float* o) {
  float mx = -INFINITY, total = 0.0f;
  for (int c = 0; c < C; c++) mx = st[2 * c] > mx ? st[2 * c] : mx;
  for (int d = 0; d < D; d++) o[d] = 0.0f;
  for (int c = 0; c < C; c++) {
    const float w = st[2 * c + 1] * expf(st[2 * c] - mx);
    total += w;
    for (int d = 0; d < D; d++) o[d] += w * co[(int64_t)c * D + d];
  }
  for (int d = 0; d < D; d++) o[d] /= total;
}

/* A step's attention work items, the same at every layer: built once a step. */
typedef struct {
  int (*item)[5];  /* [first row, rows, first query head, heads, chunk (-1: whole)] */
  int n_items, C, CH;
  char* chunked;   /* row r's keys in chunks */
  float *co, *cst; /* a row of more than one chunk: its chunks' outputs [R][H][C][D] and max, sum [R][H][C][2] */
} AttPlan;

static void att_plan(const Model* M, int R, const int64_t* pos, const int64_t* page_at, int64_t span, AttPlan* A) {
  const int H = M->heads, D = M->head_dim, G = H / M->kv_heads, CH = chunk_of(M);
  const int C = (int)((span + CH - 1) / CH);  /* chunks of the longest row */
  /* items: the G query heads of a KV head
     together (they read the same K/V, once), for one row or for a sequence's rows (in
     pieces of at most ATT_MAXQ queries: a piece re-reads the keys, and pieces that fit
     one vector of lanes measured slower than whole sequences on fewer threads). One
     row alone in a step of a model with fewer KV heads than threads: one item per
     query head, so that every thread has one. (SmolLM2, 3 KV heads on 2 threads: one
     item per query head read each K/V row 3 times, and a single stream took 4-13%
     longer a token at 150-900 positions; docs/BENCHMARKS.md 26.) */
  int (*item)[5] = malloc(sizeof(int[5]) * ((size_t)R * H * C + 1));
  char* chunked = malloc((size_t)R);
  int n_items = 0;
  const int grouped = R > 1 || M->kv_heads >= omp_get_max_threads();
  const int per_kv = grouped && G <= ATT_MAXQ ? G : 1;  /* (G past ATT_MAXQ: one query head an item) */
  for (int r = 0; r < R;) {
    int end = r + 1;
    while (end < R && page_at[end] == page_at[r]) end++;
    int piece = ATT_MAXQ / per_kv;
    /* A step that is one sequence alone (a speculative verify) on a model with few KV
       heads: two pieces, so that both threads have items (3 KV heads on 2 threads were 2:1;
       copy-text with speculation 1.10-1.16x less time a token in 3 of 6 A/B runs, equal
       in the others; docs/BENCHMARKS.md 26). */
    if (r == 0 && end == R && R >= 4 && M->kv_heads < 2 * omp_get_max_threads())
      piece = piece < (R + 1) / 2 ? piece : (R + 1) / 2;
    while (r < end) {
      const int rows = end - r < piece ? end - r : piece;
      int64_t last = 0;  /* the piece's longest row: its chunks */
      for (int i = r; i < r + rows; i++) last = pos[i] + 1 > last ? pos[i] + 1 : last;
      const int by_chunk = rows * per_kv < ATT_LANES_MIN;
      for (int i = r; i < r + rows; i++) chunked[i] = (char)(by_chunk && pos[i] >= CH);
      for (int c = 0; by_chunk ? c * (int64_t)CH < last : c < 1; c++)
        for (int h = 0; h < H; h += per_kv) {
          int* it = item[n_items++];
          it[0] = r, it[1] = rows, it[2] = h, it[3] = per_kv, it[4] = by_chunk ? c : -1;
        }
      r += rows;
    }
  }
  int any = 0;
  for (int r = 0; r < R; r++) any |= chunked[r];
  A->co = any ? malloc(sizeof(float) * (size_t)R * H * C * (D + 2)) : NULL;
  A->cst = A->co ? A->co + (int64_t)R * H * C * D : NULL;
  A->item = item, A->n_items = n_items, A->C = C, A->CH = CH, A->chunked = chunked;
}

static void att_plan_free(AttPlan* A) {
  free(A->co);
  free(A->chunked);
  free(A->item);
}

/* A thread's attention scratch (att_item's `work`), in floats. */
static inline size_t att_work_floats(const Model* M) {
  return (size_t)M->head_dim * ((ATT_MAXQ + LANES - 1) / LANES * LANES + 1);
}

/* Layer l's attention shared by the threads of the enclosing parallel region (orphaned
   worksharing, as f32_panel_mm_team), each with its own `work`. */
static void att_team(const Model* M, const AttPlan* A, int l, int R, const float* q, int64_t q_stride, float* o,
                     const int64_t* pos, const int64_t* page_at, const int64_t* pages, float* p, int64_t span,
                     float* work) {
  const int H = M->heads, D = M->head_dim, G = H / M->kv_heads, C = A->C, CH = A->CH;
  #pragma omp for schedule(dynamic, 1)
  for (int w = 0; w < A->n_items; w++) {
    const int* it = A->item[w];
    Queries Q;
    Q.nq = 0, Q.lo = it[4] < 0 ? 0 : it[4] * CH, Q.hi = it[4] < 0 ? (int)span : Q.lo + CH;
    for (int r = it[0]; r < it[0] + it[1]; r++) {
      if (pos[r] < Q.lo) continue;  /* this row's keys end before the chunk */
      const int whole = !A->chunked[r];  /* the row's only item: the output itself */
      for (int h = it[2]; h < it[2] + it[3]; h++) {
        const int64_t rh = (int64_t)r * H + h;
        Q.q[Q.nq] = q + (int64_t)r * q_stride + (int64_t)h * D;
        Q.o[Q.nq] = whole ? o + rh * D : A->co + (rh * C + it[4]) * D;
        Q.st[Q.nq] = whole ? NULL : A->cst + (rh * C + it[4]) * 2;
        Q.p[Q.nq] = p + rh * span;
        Q.n[Q.nq++] = (int)pos[r] + 1;
      }
    }
    if (Q.nq) att_item(M, l, it[2] / G, &Q, pages + page_at[it[0]], work);
  }
  if (A->co) {
    #pragma omp for schedule(static)
    for (int rh = 0; rh < R * H; rh++) {
      const int64_t n = pos[rh / H] + 1;
      if (A->chunked[rh / H]) merge_chunks((int)((n + CH - 1) / CH), D, A->co + (int64_t)rh * C * D,
                                           A->cst + (int64_t)rh * C * 2, o + (int64_t)rh * D);
    }
  }
}

/* The same in a parallel region of its own (the eager path's decode_attention). */
static void attend(const Model* M, int l, int R, const float* q, int64_t q_stride, float* o,
                   const int64_t* pos, const int64_t* page_at, const int64_t* pages, float* p, int64_t span) {
  AttPlan A;
  att_plan(M, R, pos, page_at, span, &A);
  #pragma omp parallel if (R * span >= 32)
  {
    float* work = malloc(sizeof(float) * att_work_floats(M));
    att_team(M, &A, l, R, q, q_stride, o, pos, page_at, pages, p, span, work);
    free(work);
  }
  att_plan_free(&A);
}

/* The same attention for the decode rows of an eager step (attention/cpu.py, their K/V
   already in the pool): q and o [R][H][D]; scratch R * H * (max pos + 1) floats. Only the
   Model's head geometry and pool fields are read. */
void decode_attention(const Model* M, int l, int R, const float* q, float* o, const int64_t* pos,
                      const int64_t* page_at, const int64_t* pages, float* scratch) {
  int64_t span = 0;
  for (int r = 0; r < R; r++) span = pos[r] + 1 > span ? pos[r] + 1 : span;
  attend(M, l, R, q, (int64_t)M->heads * M->head_dim, o, pos, page_at, pages, scratch, span);
}

/* The same row-wise loops for the rows of an eager step (a prefill chunk, a mixed step:
   quant/glue.py), where torch's ops take 3-6 passes over the activations each. */
void rows_rms(int R, int n, const float* x, int64_t stride, const float* w, float eps, float* out) {
  #pragma omp parallel for schedule(static) if (R >= 16)
  for (int r = 0; r < R; r++) rms(x + r * stride, w, out + (int64_t)r * n, n, eps);
}

/* In place: row r's `heads` heads of d values at x + r * stride + j * d, at position pos[r]. */
void rows_rope(int R, int heads, int d, float* x, int64_t stride, const float* cos, const float* sin,
               const int64_t* pos) {
  #pragma omp parallel for schedule(static) if (R >= 16)
  for (int r = 0; r < R; r++)
    for (int j = 0; j < heads; j++) rope(x + r * stride + j * d, cos + pos[r] * d, sin + pos[r] * d, d);
}

/* a [R][I] = silu(gu[r][0 .. I)) * gu[r][I .. 2I). */
void rows_silu_mul(int R, int I, const float* gu, float* a) {
  #pragma omp parallel for schedule(static) if (R >= 4)
  for (int r = 0; r < R; r++) silu_mul(gu + (int64_t)r * 2 * I, gu + (int64_t)r * 2 * I + I, a + (int64_t)r * I, I);
}

/* Row `id` of the embedding table into out[K]: float32 panels read down one lane (a
   tied head's table is its panels: groups.c), int4/int8 blocks widened (int4x16.c's
   lookup). */
static void embed_row(const Lin* e, int64_t id, float* out) {
  if (!e->d) {
    const float* col = (const float*)e->q + (id / PANEL) * (int64_t)e->k * PANEL + id % PANEL;
    for (int k = 0; k < e->k; k++) out[k] = col[(int64_t)k * PANEL];
  } else {
    x16_row(e->k, e->q, e->d, e->m, id, out);
  }
}

/* The index of the largest of x[0 .. n): the first of equal ones, the first NaN if any
   (numpy's and torch's argmax). A vector pass finds the largest value and whether a NaN
   is there, a scalar pass where it first is: in the sampler this was ~0.1 ms of a one-row
   step's Python (the conversions' code cold after the weights' stream). */
static int64_t argmax_of(const float* x, int n) {
  int i = 0;
  VEC mx = VSET1(-INFINITY);
  int nan = 0;
  for (; i + LANES <= n; i += LANES) {
    VEC v = VLOAD(x + i);
#ifdef __AVX512F__
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
#else
    nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0;
#endif
    mx = VMAX(mx, v);
  }
  float best = -INFINITY;
  float lane[LANES];
  VSTORE(lane, mx);
  for (int j = 0; j < LANES; j++) best = lane[j] > best ? lane[j] : best;
  for (int j = i; j < n; j++) {
    nan |= isnan(x[j]);
    best = x[j] > best ? x[j] : best;
  }
  for (int j = 0; j < n; j++)
    if (nan ? isnan(x[j]) : x[j] == best) return j;
  return 0;
}

/* top[r] = argmax_of(x[r][0 .. n)) for each of R rows, shared by the threads of an
   enclosing parallel region (fused_decode's), else by the caller alone. */
void rows_argmax(int R, int n, const float* x, int64_t* top) {
  #pragma omp for schedule(static)
  for (int r = 0; r < R; r++) top[r] = argmax_of(x + (int64_t)r * n, n);
}

/* Floats of scratch fused_decode needs (fused_decode.py allocates it). */
int64_t fused_decode_scratch(const Model* M, int R, int64_t span) {
  Scratch S;
  return carve(M, R, span, NULL, &S);
}

/* h [R][hidden]: the rows' embeddings in (or, with ids, looked up here from M->embed),
   their final hidden states out. cos/sin: the model's [positions][head_dim] tables; pos,
   slot: each row's position and pool slot; pages[page_at[r] ..]: row r's pages in order
   (position t in page t / page_size). logits [R][vocab] (NULL: not wanted): every row's
   final norm and LM head, in this call, and with top (NULL: not wanted) each row's argmax.
   Why here: between two native calls the step's Python ran with caches the layers' weights
   had just swept, ~0.3 ms of a ~17 ms float32 step (docs/BENCHMARKS.md 29); so did the
   embedding's and argmax's torch and numpy calls (~0.2 ms; section 30). */
void fused_decode(const Model* M, int R, float* h, const int64_t* ids, const float* cos, const float* sin,
                  const int64_t* pos, const int64_t* slot, const int64_t* page_at, const int64_t* pages,
                  float* scratch, float* logits, int64_t* top) {
  const int H = M->heads, KVH = M->kv_heads, D = M->head_dim, E = M->hidden, I = M->inter;
  const int QKV = (H + 2 * KVH) * D;
  if (ids)
    for (int r = 0; r < R; r++) embed_row(&M->embed, ids[r], h + (int64_t)r * E);
  int64_t span = 0;
  for (int r = 0; r < R; r++) span = pos[r] + 1 > span ? pos[r] + 1 : span;
  Scratch S;
  carve(M, R, span, scratch, &S);
  float *x = S.x, *qkv = S.qkv, *o = S.o, *gu = S.gu, *a = S.a, *y = S.y, *p = S.p, *xs = S.xs;
  AttPlan A;
  att_plan(M, R, pos, page_at, span, &A);
  /* One parallel region for the whole step: the threads meet at each product's end (and
     wait while one of them runs a row loop, `single`), but are not started and ended ~5
     times a layer. */
  #pragma omp parallel
  {
    float* work = malloc(sizeof(float) * att_work_floats(M));
    for (int l = 0; l < M->layers; l++) {
      const Layer* L = &M->layer[l];
      #pragma omp single
      for (int r = 0; r < R; r++) rms(h + (int64_t)r * E, L->in_norm, x + (int64_t)r * E, E, M->eps);
      lin_team(&L->qkv, R, x, qkv, xs);
      #pragma omp single
      {
        int64_t pl = (int64_t)l * KVH * M->pool_slots * D;
        for (int r = 0; r < R; r++) {
          float *q = qkv + (int64_t)r * QKV, *k = q + H * D, *v = k + KVH * D;
          const float *c = cos + pos[r] * D, *s = sin + pos[r] * D;
          if (L->q_norm) {
            for (int j = 0; j < H; j++) rms(q + j * D, L->q_norm, q + j * D, D, M->eps);
            for (int j = 0; j < KVH; j++) rms(k + j * D, L->k_norm, k + j * D, D, M->eps);
          }
          for (int j = 0; j < H; j++) rope(q + j * D, c, s, D);
          for (int j = 0; j < KVH; j++) rope(k + j * D, c, s, D);
          for (int j = 0; j < KVH; j++) {
            store_kv(M, M->pool_k, pl + ((int64_t)j * M->pool_slots + slot[r]) * D, k + j * D, D);
            store_kv(M, M->pool_v, pl + ((int64_t)j * M->pool_slots + slot[r]) * D, v + j * D, D);
          }
        }
      }
      att_team(M, &A, l, R, qkv, QKV, o, pos, page_at, pages, p, span, work);
      lin_team(&L->o, R, o, y, xs);
      #pragma omp single
      {
        for (int64_t i = 0; i < (int64_t)R * E; i++) h[i] += y[i];
        for (int r = 0; r < R; r++) rms(h + (int64_t)r * E, L->post_norm, x + (int64_t)r * E, E, M->eps);
      }
      lin_team(&L->gate_up, R, x, gu, xs);
      #pragma omp for schedule(static)
      for (int r = 0; r < R; r++) silu_mul(gu + (int64_t)r * 2 * I, gu + (int64_t)r * 2 * I + I, a + (int64_t)r * I, I);
      lin_team(&L->down, R, a, y, xs);
      #pragma omp single
      for (int64_t i = 0; i < (int64_t)R * E; i++) h[i] += y[i];
    }
    if (logits) {
      #pragma omp single
      for (int r = 0; r < R; r++) rms(h + (int64_t)r * E, M->norm, x + (int64_t)r * E, E, M->eps);
      lin_team(&M->head, R, x, logits, xs);
      if (top) rows_argmax(R, M->head.n, logits, top);
    }
    free(work);
  }
  att_plan_free(&A);
}


/* `n` greedy decode steps of R rows in one call (--decode-steps): step i feeds each row the
   token step i - 1 chose (its argmax), at the next position, into the slot its pages hold
   for it; ids and pos are step 0's; pages[page_at[r] ..] must hold row r's positions up to
   pos[r] + n - 1 (the scheduler holds them). top [n][R]: each step's argmax; logits: the
   last step's. Each step is fused_decode's call as one decode step would make it, so the
   tokens are those of n steps; what the loop saves is the runner's Python and the
   worker's round trip between them (~0.8 ms of a ~11 ms one-row float32 step, its code cold
   after the weights' stream: docs/BENCHMARKS.md 31), and the scheduler's and frontend's
   turns, which share the two cores with the step. Scratch: fused_decode_scratch for
   span max(pos) + n. */
void fused_decode_steps(const Model* M, int R, int n, float* h, const int64_t* ids, const float* cos,
                        const float* sin, const int64_t* pos, const int64_t* page_at, const int64_t* pages,
                        float* scratch, float* logits, int64_t* top) {
  int64_t* p = malloc(sizeof(int64_t) * 2 * (size_t)R);
  int64_t* slot = p + R;
  const int ps = M->page_size;
  for (int i = 0; i < n; i++) {
    for (int r = 0; r < R; r++) {
      p[r] = pos[r] + i;
      slot[r] = pages[page_at[r] + p[r] / ps] * ps + p[r] % ps;
    }
    fused_decode(M, R, h, i ? top + (int64_t)(i - 1) * R : ids, cos, sin, p, slot, page_at, pages, scratch,
                 logits, top + (int64_t)i * R);
  }
  free(p);
}
