/* One decode row through every layer in one call: the batch-1 step of a model whose
   linear weights are groups of 32 (int4/int8, groups.c) or float32, float32 activations.

   Why: at batch 1 the eager step is ~600 small torch ops between the matmuls, each a
   few microseconds of dispatch; on SmolLM2 int4 they cost about as much as the matmuls
   themselves (docs/BENCHMARKS.md 21). Here the glue between the matmuls (RMSNorm, RoPE,
   q/k norms, the KV writes, attention over the row's contiguous K/V, SiLU-mul, the
   residual adds) is a few loops over a few thousand floats, and the matmuls are
   groups.c's one-row kernels (OpenMP over output rows). For float32 weights the same
   ~2 ms of glue per step is what stands between the eager step and the bandwidth floor.

   Numerics follow models/llama.py in float32 (RMSNorm: x * rsqrt(mean(x^2) + eps), then
   the weight; RoPE: x * cos + rotate_half(x) * sin; softmax scale head_dim ** -0.5); sums
   run in another order than torch's, so results agree within float rounding, not to the
   bit (tests/test_one_row.py bounds the difference and compares greedy tokens).

   KV: the step's K/V go to the pool (layout "hnd": [layers][kv_heads][slots][head_dim])
   at `slot`, and to the decode mirror ([layers][mirror slots][kv_heads][cap][head_dim])
   at position `pos` of mirror slot `mslot`; attention reads the mirror's positions
   0..pos, as attention/cpu.py's mirror path does. */
#include <math.h>
#include <string.h>
#include "groups.c"

typedef struct {
  const uint8_t* q; const uint16_t* d; const uint16_t* m;  /* m NULL: int8; d NULL: q is float32 */
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
  float *pool_k, *pool_v;  /* [layers][kv_heads][slots][head_dim] */
  int64_t pool_slots;
  float *mir_k, *mir_v;    /* [layers][mirror slots][kv_heads][cap][head_dim] */
  int64_t mir_slots, mir_cap;
} Model;

static void lin(const Lin* w, const float* x, float* y, float* xs) {
  if (!w->d) f32_mm(1, w->n, w->k, x, (const float*)w->q, y);
  else if (w->m) int4_mm(1, w->n, w->k, x, w->q, w->d, w->m, xs, y);
  else int8_mm(1, w->n, w->k, x, (const int8_t*)w->q, w->d, y);
  if (w->bias) for (int i = 0; i < w->n; i++) y[i] += w->bias[i];
}

#ifdef __AVX512F__
#define VADD _mm512_add_ps
#define VSUB _mm512_sub_ps
#define VMAX _mm512_max_ps
#define VROUND(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define VPOW2(y, n) _mm512_scalef_ps(y, n)
#else
#define VADD _mm256_add_ps
#define VSUB _mm256_sub_ps
#define VMAX _mm256_max_ps
#define VROUND(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
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

/* h [hidden]: the row's embedding in, its final hidden state out. cos/sin: [head_dim]
   at the row's position. scratch: at least hidden * 2 + (heads + 2 * kv_heads) *
   head_dim + heads * head_dim + 2 * inter + (pos + 1) * heads + K / 32 floats. */
void one_row_decode(const Model* M, float* h, const float* cos, const float* sin,
                    int64_t slot, int64_t mslot, int64_t pos, float* scratch) {
  const int H = M->heads, KVH = M->kv_heads, D = M->head_dim, E = M->hidden, I = M->inter;
  const int G = H / KVH, span = (int)pos + 1;
  const float scale = 1.0f / sqrtf((float)D);
  float *x = scratch, *qkv = x + E, *o = qkv + (H + 2 * KVH) * D, *gu = o + H * D,
        *y = gu + 2 * I, *p = y + E, *xs = p + (int64_t)span * H;
  for (int l = 0; l < M->layers; l++) {
    const Layer* L = &M->layer[l];
    rms(h, L->in_norm, x, E, M->eps);
    lin(&L->qkv, x, qkv, xs);
    float *q = qkv, *k = qkv + H * D, *v = k + KVH * D;
    if (L->q_norm) {
      for (int j = 0; j < H; j++) rms(q + j * D, L->q_norm, q + j * D, D, M->eps);
      for (int j = 0; j < KVH; j++) rms(k + j * D, L->k_norm, k + j * D, D, M->eps);
    }
    for (int j = 0; j < H; j++) rope(q + j * D, cos, sin, D);
    for (int j = 0; j < KVH; j++) rope(k + j * D, cos, sin, D);
    int64_t pl = (int64_t)l * KVH * M->pool_slots * D;
    int64_t ml = ((int64_t)l * M->mir_slots + mslot) * KVH * M->mir_cap * D;
    for (int j = 0; j < KVH; j++) {
      memcpy(M->pool_k + pl + ((int64_t)j * M->pool_slots + slot) * D, k + j * D, D * sizeof(float));
      memcpy(M->pool_v + pl + ((int64_t)j * M->pool_slots + slot) * D, v + j * D, D * sizeof(float));
      memcpy(M->mir_k + ml + ((int64_t)j * M->mir_cap + pos) * D, k + j * D, D * sizeof(float));
      memcpy(M->mir_v + ml + ((int64_t)j * M->mir_cap + pos) * D, v + j * D, D * sizeof(float));
    }
    /* Attention: each query head over its KV head's positions 0..pos (heads in parallel
       once the context makes it worth a fork). */
    #pragma omp parallel for schedule(static) if (span >= 32)
    for (int j = 0; j < H; j++) {
      const float* Kh = M->mir_k + ml + (int64_t)(j / G) * M->mir_cap * D;
      const float* Vh = M->mir_v + ml + (int64_t)(j / G) * M->mir_cap * D;
      const float* qj = q + j * D;
      float* pj = p + (int64_t)j * span;
      float mx = -INFINITY;
      for (int t = 0; t < span; t++) {
        pj[t] = dot(qj, Kh + (int64_t)t * D, D) * scale;
        if (pj[t] > mx) mx = pj[t];
      }
      float sum = exp_sum(pj, span, mx);
      float* oj = o + j * D;
      for (int i = 0; i < D; i++) oj[i] = 0;
      for (int t = 0; t < span; t++) {
        float w = pj[t] / sum;
        for (int i = 0; i < D; i++) oj[i] += w * Vh[(int64_t)t * D + i];
      }
    }
    lin(&L->o, o, y, xs);
    for (int i = 0; i < E; i++) h[i] += y[i];
    rms(h, L->post_norm, x, E, M->eps);
    lin(&L->gate_up, x, gu, xs);
    for (int i = 0; i < I; i++) { float g = gu[i]; gu[i] = g / (1.0f + expf(-g)) * gu[I + i]; }
    lin(&L->down, gu, y, xs);
    for (int i = 0; i < E; i++) h[i] += y[i];
  }
}
