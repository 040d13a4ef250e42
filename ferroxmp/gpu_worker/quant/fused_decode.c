/* Decode rows (one token each, up to 16) through every layer in one call: the decode
   step of a model whose linear weights are groups of 32 (int4/int8, groups.c) or float32,
   float32 activations.

   Why: the eager step is ~600 small torch ops between the matmuls, each a few
   microseconds of dispatch, whatever the batch: on SmolLM2 int4 at batch 1 they cost about
   as much as the matmuls themselves (docs/BENCHMARKS.md 21), and in float32 they are what
   stands between the step and the bandwidth floor. Here the glue between the matmuls
   (RMSNorm, RoPE, q/k norms, the KV writes, attention over each row's contiguous K/V,
   SiLU-mul, the residual adds) is a few loops over a few thousand floats per row, and the
   matmuls are groups.c's small-M kernels (OpenMP over output rows), every row of the step
   in one pass over each weight. Past 16 rows MKL's GEMM multiplies float32 faster
   (packed.cpu_f32_linear's range) and the step runs eagerly.

   Numerics follow models/llama.py in float32 (RMSNorm: x * rsqrt(mean(x^2) + eps), then
   the weight; RoPE: x * cos + rotate_half(x) * sin; softmax scale head_dim ** -0.5); sums
   run in another order than torch's, so results agree within float rounding, not to the
   bit (tests/test_fused_decode.py bounds the difference and compares greedy tokens). A
   row's sums do not depend on the other rows of the step (groups.c's blocks), except that
   int4 takes another order for a step of exactly one row (row_one).

   KV: row r's K/V go to the pool (layout "hnd": [layers][kv_heads][slots][head_dim];
   float32, or float16 under --kv-cache-dtype float16: store_kv) at `slot[r]`, and
   attention reads positions 0..pos[r] back from the row's pages there (the step's own
   K/V as stored: rounded, in a float16 pool, as attention/cpu.py reads them). The decode
   mirror is not touched: it serves the eager steps only, which refill it from the pool.
*/
#include <math.h>
#include <string.h>
#include "groups.c"
#include "int4x16.c"

typedef struct {
  const uint8_t* q; const uint16_t* d; const uint16_t* m;  /* m: int4 (int4x16.c); NULL: int8; d NULL: float32 */
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



/* y[R][n] = x[R][k] W^T (+ bias). xs: the int4 kernel's scratch (int4x16_scratch bytes). */
static void lin(const Lin* w, int R, const float* x, float* y, float* xs) {
  if (!w->d) f32_mm(R, w->n, w->k, x, (const float*)w->q, y);
  else if (w->m) int4x16_mm(R, w->n, w->k, x, w->q, w->d, w->m, xs, y);
  else int8_mm(R, w->n, w->k, x, (const int8_t*)w->q, w->d, y);
  if (w->bias)
    for (int r = 0; r < R; r++)
      for (int i = 0; i < w->n; i++) y[(int64_t)r * w->n + i] += w->bias[i];
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

/* Attention of R decoding rows at layer l: row r's H query heads (q + r * q_stride, H x D)
   over its KV head's positions 0..pos[r], read from the row's pages in the pool (a page
   of one head: page_size contiguous positions); o [R][H][D]; p [R][H][span] scratch for
   the scores. (Row, head) pairs in parallel once the contexts make it worth a fork. */
static void attend(const Model* M, int l, int R, const float* q, int64_t q_stride, float* o,
                   const int64_t* pos, const int64_t* page_at, const int64_t* pages, float* p, int64_t span) {
  const int H = M->heads, D = M->head_dim, G = H / M->kv_heads, ps = M->page_size;
  const float scale = 1.0f / sqrtf((float)D);
  const int64_t pl = (int64_t)l * M->kv_heads * M->pool_slots * D;
  #pragma omp parallel for collapse(2) schedule(static) if (R * span >= 32)
  for (int r = 0; r < R; r++)
    for (int j = 0; j < H; j++) {
      const int n = (int)pos[r] + 1;
      const int64_t* pg = pages + page_at[r];
      const int64_t head = pl + (int64_t)(j / G) * M->pool_slots * D;  /* this layer's KV head */
      const float* qj = q + (int64_t)r * q_stride + j * D;
      float* pj = p + ((int64_t)r * H + j) * span;
      float mx = -INFINITY;
      for (int t0 = 0; t0 < n; t0 += ps) {  /* page by page (a division per key costs) */
        const int64_t at = head + pg[t0 / ps] * ps * D;
        for (int t = t0; t < n && t < t0 + ps; t++) {
          pj[t] = dot_kv(M, qj, M->pool_k, at + (int64_t)(t - t0) * D, D) * scale;
          if (pj[t] > mx) mx = pj[t];
        }
      }
      float sum = exp_sum(pj, n, mx);
      float* oj = o + ((int64_t)r * H + j) * D;
      for (int i = 0; i < D; i++) oj[i] = 0;
      for (int t0 = 0; t0 < n; t0 += ps) {
        const int64_t at = head + pg[t0 / ps] * ps * D;
        for (int t = t0; t < n && t < t0 + ps; t++)
          axpy_kv(M, oj, pj[t] / sum, M->pool_v, at + (int64_t)(t - t0) * D, D);
      }
    }
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

/* Floats of scratch fused_decode needs (fused_decode.py allocates it). */
int64_t fused_decode_scratch(const Model* M, int R, int64_t span) {
  Scratch S;
  return carve(M, R, span, NULL, &S);
}

/* h [R][hidden]: the rows' embeddings in, their final hidden states out. cos/sin: the
   model's [positions][head_dim] tables; pos, slot: each row's position and pool slot;
   pages[page_at[r] ..]: row r's pages in order (position t in page t / page_size). */
void fused_decode(const Model* M, int R, float* h, const float* cos, const float* sin,
                  const int64_t* pos, const int64_t* slot, const int64_t* page_at, const int64_t* pages,
                  float* scratch) {
  const int H = M->heads, KVH = M->kv_heads, D = M->head_dim, E = M->hidden, I = M->inter;
  const int QKV = (H + 2 * KVH) * D;
  int64_t span = 0;
  for (int r = 0; r < R; r++) span = pos[r] + 1 > span ? pos[r] + 1 : span;
  Scratch S;
  carve(M, R, span, scratch, &S);
  float *x = S.x, *qkv = S.qkv, *o = S.o, *gu = S.gu, *a = S.a, *y = S.y, *p = S.p, *xs = S.xs;
  for (int l = 0; l < M->layers; l++) {
    const Layer* L = &M->layer[l];
    for (int r = 0; r < R; r++) rms(h + (int64_t)r * E, L->in_norm, x + (int64_t)r * E, E, M->eps);
    lin(&L->qkv, R, x, qkv, xs);
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
    attend(M, l, R, qkv, QKV, o, pos, page_at, pages, p, span);
    lin(&L->o, R, o, y, xs);
    for (int64_t i = 0; i < (int64_t)R * E; i++) h[i] += y[i];
    for (int r = 0; r < R; r++) rms(h + (int64_t)r * E, L->post_norm, x + (int64_t)r * E, E, M->eps);
    lin(&L->gate_up, R, x, gu, xs);
    #pragma omp parallel for schedule(static) if (R >= 4)
    for (int r = 0; r < R; r++) silu_mul(gu + (int64_t)r * 2 * I, gu + (int64_t)r * 2 * I + I, a + (int64_t)r * I, I);
    lin(&L->down, R, a, y, xs);
    for (int64_t i = 0; i < (int64_t)R * E; i++) h[i] += y[i];
  }
}
