/* int4 weights in blocks of 16 rows times activations on a 16-bit grid (quant/int4x16.py):
   the int4 multiply of every step (decode rows and prefill chunks alike). Included by
   fused_decode.c after groups.c (h2f, PREFETCH).

   Layout. Block b holds rows 16b .. 16b+15 (the last block padded with zero rows); group g
   of a block is 256 bytes: 4 pairs p of 64 bytes, byte k of pair p holding row 16b + k/4's
   value 8p + k%4 in its low nibble and value 8p + 4 + k%4 in its high one. So one pair's
   two nibble planes are two registers of 16 lanes (AVX-512; two halves of 8 under AVX2),
   lane i holding 4 consecutive values of row i: an integer dot product with 4 activation
   values broadcast to every lane advances 16 rows at once, and the 8 of a group sum in
   int32 before the group's scales are applied. d, m: float16 [blocks][groups][16].
   Values as in groups.c: w = q * d + m, q in 0..15.

   Activations: each row's group of 32 is rounded to v = round(x / s), s = max|x| / 32258
   (a grid of 2 * 32258 steps, 16 bits), held as two int8 digits v = 254 * hi + lo, each
   multiplied by the weights with the integer dot product above; then
     y = sum_g d_g * s_g * (q . v)_g + m_g * s_g * sum(v)_g,
   the dequantized weight times the rounded activations, exactly up to float32 rounding:
   the error against float32 is sum w * (s v - x), at most sum_g s_g / 2 * sum|w|_g, 1/64516
   of each group's largest activation per value. tests/int4_oracle.py is this formula in
   float64. One int8 digit alone (llama.cpp's Q8_1, 1/254) halved the work again but moved
   a close call of SmolLM2's greedy answers (the capital of France) and its hidden states
   by ~2% under a 1e-7 change of the input (docs/BENCHMARKS.md 24).

   Why: groups.c's float path widened every value to a float lane and spent one FMA per
   value per activation row; here a value costs 1/32 of an integer instruction per row
   (two vpdpbusd of 64 products, one per digit; AVX2 or AVX-512 without VNNI: vpmaddubsw +
   vpmaddwd), and the unpack is two ANDs and a shift per 128 values (docs/BENCHMARKS.md 24). */

#define X16 16        /* rows per block */
#define X16_MB 16     /* activation rows per pass over a block's groups (accumulators) */
#define X16_BYTES 256 /* bytes per block and group */
#define X16_GRID 32258.0f /* 127 * 254: the activations' grid, max |x| of a group at 32258 */
#define X16_TINY 1e-30f   /* a group whose max |x| is below this counts as zeros (32258 / max|x| would overflow) */

/* One activation row's groups, each rounded to v = round(x / s), s = max|x| / 32258, and v
   split into two int8 digits v = 254 * hi + lo (hi = round(v / 254), so |lo| <= 127): xq
   [K / 32][64] holds a group's 32 hi digits then its 32 lo digits; sc [G] = s, sum [G] =
   s * sum(v); dsum [G][2] = the sums of its hi and of its lo digits (int8 weights read as
   unsigned, q + 128, take 128 times them back off). */
#ifndef __AVX512F__
static inline int x16_hsum_epi32(__m256i s4) {
  __m128i s2 = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
  s2 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xb1)));
}
#endif
static void x16_quantize_row(int K, const float* x, int8_t* xq, float* sc, float* sum, int32_t* dsum) {
  for (int g = 0; g < K / 32; g++) {
    const float* xg = x + g * 32;
    int8_t* out = xq + g * 64;
#ifdef __AVX512F__
    __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    __m512 inv = _mm512_set1_ps(amax > X16_TINY ? X16_GRID / amax : 0.0f);
    __m512i v[2] = {_mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), _mm512_cvtps_epi32(_mm512_mul_ps(b, inv))};
    __m512i hs = _mm512_setzero_si512();
    for (int h = 0; h < 2; h++) {
      __m512i hi = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_cvtepi32_ps(v[h]), _mm512_set1_ps(254.0f)));
      __m512i lo = _mm512_sub_epi32(v[h], _mm512_mullo_epi32(hi, _mm512_set1_epi32(254)));
      _mm_storeu_si128((__m128i*)(out + 16 * h), _mm512_cvtsepi32_epi8(hi));
      _mm_storeu_si128((__m128i*)(out + 32 + 16 * h), _mm512_cvtsepi32_epi8(lo));
      hs = _mm512_add_epi32(hs, hi);
    }
    const int isum = _mm512_reduce_add_epi32(_mm512_add_epi32(v[0], v[1]));
    const int shi = _mm512_reduce_add_epi32(hs);
#else
    __m256 f[4], mx = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < 4; i++) {
      f[i] = _mm256_loadu_ps(xg + 8 * i);
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, f[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    __m256 inv = _mm256_set1_ps(amax > X16_TINY ? X16_GRID / amax : 0.0f);
    __m256i v[4], hi[4], lo[4], s4 = _mm256_setzero_si256(), hs = _mm256_setzero_si256();
    for (int i = 0; i < 4; i++) {
      v[i] = _mm256_cvtps_epi32(_mm256_mul_ps(f[i], inv));
      hi[i] = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_cvtepi32_ps(v[i]), _mm256_set1_ps(254.0f)));
      lo[i] = _mm256_sub_epi32(v[i], _mm256_mullo_epi32(hi[i], _mm256_set1_epi32(254)));
      s4 = _mm256_add_epi32(s4, v[i]);
      hs = _mm256_add_epi32(hs, hi[i]);
    }
    /* packs work within 128-bit halves: the permute puts the 8 dwords back in order */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256i* t[2] = {hi, lo};
    for (int h = 0; h < 2; h++) {
      __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(t[h][0], t[h][1]), _mm256_packs_epi32(t[h][2], t[h][3]));
      _mm256_storeu_si256((__m256i*)(out + 32 * h), _mm256_permutevar8x32_epi32(p, order));
    }
    const int isum = x16_hsum_epi32(s4), shi = x16_hsum_epi32(hs);
#endif
    sc[g] = amax / X16_GRID;
    sum[g] = sc[g] * (float)isum;
    dsum[2 * g] = shi, dsum[2 * g + 1] = isum - 254 * shi;  /* v = 254 hi + lo, summed */
  }
}

#ifdef __AVX512BW__
/* q . digits for 16 rows: w [8] a group's pairs' nibble planes, x4 [8] its 32 digits as 4-byte words. */
static inline __m512i x16_dot(const __m512i w[8], const int32_t* x4) {
#ifdef __AVX512VNNI__
  /* two chains of 4: one chain of 8 dependent vpdpbusd waits on its latency at few rows */
  __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
  for (int j = 0; j < 8; j += 2) {
    a0 = _mm512_dpbusd_epi32(a0, w[j], _mm512_set1_epi32(x4[j]));
    a1 = _mm512_dpbusd_epi32(a1, w[j + 1], _mm512_set1_epi32(x4[j + 1]));
  }
  return _mm512_add_epi32(a0, a1);
#else
  /* 8 x 2 products of at most 15 * 127 each: 30,480 fits int16 (no saturation) */
  __m512i s16 = _mm512_setzero_si512();
  for (int j = 0; j < 8; j++) s16 = _mm512_add_epi16(s16, _mm512_maddubs_epi16(w[j], _mm512_set1_epi32(x4[j])));
  return _mm512_madd_epi16(s16, _mm512_set1_epi16(1));
#endif
}

/* int8: q . digits for 16 rows, w [8] a group's 8 chunks (values 4j .. 4j+3 of each row,
   signed) as prepared by x16_block: VNNI, q + 128 (unsigned; the caller takes 128 times
   the digits' sum back off); otherwise |q|, and each digit takes q's sign (vpmaddubsw
   multiplies unsigned by signed: |q| * 127 * 2 = 32,258 fits int16, widened at once). */
static inline __m512i x16_dot8(const __m512i wa[8], const __m512i w[8], const int32_t* x4) {
#ifdef __AVX512VNNI__
  (void)w;
  return x16_dot(wa, x4);
#else
  const __m512i zero = _mm512_setzero_si512(), ones = _mm512_set1_epi16(1);
  __m512i acc = zero;
  for (int j = 0; j < 8; j++) {
    const __m512i x = _mm512_set1_epi32(x4[j]);
    const __m512i xs = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w[j]), zero, x);
    acc = _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(wa[j], xs), ones));
  }
  return acc;
#endif
}

/* A block's group times `mb` activation rows (mb and int8 constants at each call: the
   accumulators f stay in registers), out [mb][16]. int8: a group is 512 bytes, 8 chunks
   of 64 (chunk j: 4 bytes a row, its values 4j .. 4j+3), no m. */
static inline __attribute__((always_inline)) void x16_block(int int8, int G, int mb, const int8_t* xq,
    const float* sc, const float* sum, const int32_t* dsum, const uint8_t* qb, const uint16_t* db,
    const uint16_t* mbk, float* out) {
  __m512 f[X16_MB];
  const __m512i m4 = _mm512_set1_epi8(15);
  const int gbytes = int8 ? 2 * X16_BYTES : X16_BYTES;
  for (int r = 0; r < mb; r++) f[r] = _mm512_setzero_ps();
  for (int g = 0; g < G; g++) {
    const uint8_t* qg = qb + (int64_t)g * gbytes;
    /* Every line of the group PREFETCH bytes ahead, non-temporally: a plain stream swept
       the step's other data and code out of the caches (as groups.c's panels). One-row
       int4 SmolLM2 step alternated with two lines a group as T0: 4.7 vs 5.1-5.3 ms (-8%,
       768-2,048 bytes ahead alike; docs/BENCHMARKS.md 29). */
    for (int b = 0; b < gbytes; b += 64) _mm_prefetch((const char*)qg + PREFETCH + b, _MM_HINT_NTA);
    __m512i w[8], wa[8];
    if (int8) {
      for (int j = 0; j < 8; j++) {
        w[j] = _mm512_loadu_si512(qg + 64 * j);
#ifdef __AVX512VNNI__
        wa[j] = _mm512_xor_si512(w[j], _mm512_set1_epi8((char)0x80));
#else
        wa[j] = _mm512_abs_epi8(w[j]);
#endif
      }
    } else {
      for (int p = 0; p < 4; p++) {
        __m512i raw = _mm512_loadu_si512(qg + 64 * p);
        w[2 * p] = _mm512_and_si512(raw, m4);
        w[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
      }
    }
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(db + g * 16)));
    __m512 m = int8 ? _mm512_setzero_ps() : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(mbk + g * 16)));
    for (int r = 0; r < mb; r++) {
      const int32_t* x4 = (const int32_t*)(xq + (int64_t)r * G * 64 + g * 64);
      const int64_t rg = (int64_t)r * G + g;
      __m512i acc, hi;  /* the lo digits, then 254 * the hi ones */
      if (int8) {
        acc = x16_dot8(wa, w, x4 + 8);
        hi = x16_dot8(wa, w, x4);
#ifdef __AVX512VNNI__
        acc = _mm512_sub_epi32(acc, _mm512_set1_epi32(128 * dsum[2 * rg + 1]));
        hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(128 * dsum[2 * rg]));
#endif
      } else {
        acc = x16_dot(w, x4 + 8);
        hi = x16_dot(w, x4);
      }
      acc = _mm512_add_epi32(acc, _mm512_sub_epi32(_mm512_slli_epi32(hi, 8), _mm512_slli_epi32(hi, 1)));
      f[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(sc[rg])), d, f[r]);
      if (!int8) f[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sum[rg]), f[r]);
    }
  }
  for (int r = 0; r < mb; r++) _mm512_storeu_ps(out + r * 16, f[r]);
}
#define X16_HALVES 1
#else
/* AVX2: half h of a block (rows 8h .. 8h+7: the first or second 32 bytes of each pair),
   4 activation rows at a time (16 registers). */
static inline __attribute__((always_inline)) void x16_half(int int8, int G, int h, int mb, const int8_t* xq,
    const float* sc, const float* sum, const uint8_t* qb, const uint16_t* db, const uint16_t* mbk, float* out) {
  __m256 f[4];
  const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const int gbytes = int8 ? 2 * X16_BYTES : X16_BYTES;
  for (int r = 0; r < mb; r++) f[r] = _mm256_setzero_ps();
  for (int g = 0; g < G; g++) {
    const uint8_t* qg = qb + (int64_t)g * gbytes + 32 * h;
    _mm_prefetch((const char*)qg + PREFETCH, _MM_HINT_T0);
    __m256i w[8], wa[8];
    if (int8) {  /* |q|, and each digit takes q's sign (vpmaddubsw: unsigned times signed) */
      for (int j = 0; j < 8; j++) {
        w[j] = _mm256_loadu_si256((const __m256i*)(qg + 64 * j));
        wa[j] = _mm256_abs_epi8(w[j]);
      }
    } else {
      for (int p = 0; p < 4; p++) {
        __m256i raw = _mm256_loadu_si256((const __m256i*)(qg + 64 * p));
        w[2 * p] = _mm256_and_si256(raw, m4);
        w[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
      }
    }
    __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(db + g * 16 + 8 * h)));
    __m256 m = int8 ? _mm256_setzero_ps() : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(mbk + g * 16 + 8 * h)));
    for (int r = 0; r < mb; r++) {
      const int32_t* x4 = (const int32_t*)(xq + (int64_t)r * G * 64 + g * 64);
      __m256i acc[2];
      for (int digit = 0; digit < 2; digit++) {  /* hi digits, lo digits */
        if (int8) {  /* |q| * 127 * 2 = 32,258: each pair fits int16, widened at once */
          acc[digit] = _mm256_setzero_si256();
          for (int j = 0; j < 8; j++) {
            const __m256i x = _mm256_sign_epi8(_mm256_set1_epi32(x4[8 * digit + j]), w[j]);
            acc[digit] = _mm256_add_epi32(acc[digit], _mm256_madd_epi16(_mm256_maddubs_epi16(wa[j], x), ones));
          }
          continue;
        }
        __m256i s16 = _mm256_setzero_si256();  /* 8 x 2 products of at most 15 * 127: fits int16 */
        for (int j = 0; j < 8; j++)
          s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(x4[8 * digit + j])));
        acc[digit] = _mm256_madd_epi16(s16, ones);
      }
      const int64_t rg = (int64_t)r * G + g;
      __m256 v = _mm256_cvtepi32_ps(_mm256_add_epi32(acc[1], _mm256_sub_epi32(_mm256_slli_epi32(acc[0], 8),
                                                                           _mm256_slli_epi32(acc[0], 1))));
      f[r] = _mm256_fmadd_ps(_mm256_mul_ps(v, _mm256_set1_ps(sc[rg])), d, f[r]);
      if (!int8) f[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sum[rg]), f[r]);
    }
  }
  for (int r = 0; r < mb; r++) _mm256_storeu_ps(out + r * 16 + 8 * h, f[r]);
}
#define X16_HALVES 2
#endif

/* Scratch bytes int4x16_mm / int8x16_mm need for M activation rows of K values: the
   digits, then per row and group s, s * sum(v) and the two digit sums. */
int64_t int4x16_scratch(int M, int K) { return 2 * (int64_t)M * K + 4 * (int64_t)M * (K / 32) * sizeof(float); }

/* y[M][N] = x[M][K] W^T for W in blocks (N rows, ceil(N / 16) blocks): int4 (m) or int8
   (int8 set: m unused). scratch: int4x16_scratch bytes. Shared by the threads of the
   enclosing parallel region, as f32_panel_mm_team. */
static inline __attribute__((always_inline)) void x16_mm_team(int int8, int M, int N, int K, const float* x,
    const uint8_t* q, const uint16_t* d, const uint16_t* m, void* scratch, float* y) {
  const int G = K / 32, NB = (N + X16 - 1) / X16, gbytes = int8 ? 2 * X16_BYTES : X16_BYTES;
  int8_t* xq = (int8_t*)scratch;
  float* sc = (float*)(xq + 2 * (int64_t)M * K);
  float* sum = sc + (int64_t)M * G;
  int32_t* dsum = (int32_t*)(sum + (int64_t)M * G);
  #pragma omp for schedule(static)
  for (int r = 0; r < M; r++)
    x16_quantize_row(K, x + (int64_t)r * K, xq + 2 * (int64_t)r * K, sc + (int64_t)r * G, sum + (int64_t)r * G,
                     dsum + 2 * (int64_t)r * G);
  #pragma omp for schedule(static)
  for (int b = 0; b < NB; b++) {
    const uint8_t* qb = q + (int64_t)b * G * gbytes;
    const uint16_t *db = d + (int64_t)b * G * 16, *mbk = int8 ? NULL : m + (int64_t)b * G * 16;
    const int rows = N - b * X16 < X16 ? N - b * X16 : X16;
    for (int r0 = 0; r0 < M; r0 += X16_MB) {
      const int mb = M - r0 < X16_MB ? M - r0 : X16_MB;
      const int8_t* xr = xq + 2 * (int64_t)r0 * K;
      const float *scr = sc + (int64_t)r0 * G, *sumr = sum + (int64_t)r0 * G;
      const int32_t* dsr = dsum + 2 * (int64_t)r0 * G;
      float out[X16_MB * 16];
#ifdef __AVX512BW__
#define MB(c) case c: x16_block(int8, G, c, xr, scr, sumr, dsr, qb, db, mbk, out); break;
      switch (mb) { MB(1) MB(2) MB(3) MB(4) MB(5) MB(6) MB(7) MB(8) MB(9) MB(10) MB(11) MB(12) MB(13) MB(14)
                    MB(15) MB(16) }
#undef MB
#else
      (void)dsr;
      for (int h = 0; h < X16_HALVES; h++)
        for (int i = 0; i < mb; i += 4) {
          const int n4 = mb - i < 4 ? mb - i : 4;
#define MB(c) case c: x16_half(int8, G, h, c, xr + 2 * (int64_t)i * K, scr + (int64_t)i * G, sumr + (int64_t)i * G, \
                               qb, db, mbk, out + i * 16); break;
          switch (n4) { MB(1) MB(2) MB(3) MB(4) }
#undef MB
        }
#endif
      for (int r = 0; r < mb; r++)
        for (int i = 0; i < rows; i++) y[(int64_t)(r0 + r) * N + b * X16 + i] = out[r * 16 + i];
    }
  }
}

void int4x16_mm(int M, int N, int K, const float* x, const uint8_t* q, const uint16_t* d, const uint16_t* m,
                void* scratch, float* y) {
  #pragma omp parallel
  x16_mm_team(0, M, N, K, x, q, d, m, scratch, y);
}

void int8x16_mm(int M, int N, int K, const float* x, const int8_t* q, const uint16_t* d, void* scratch, float* y) {
  #pragma omp parallel
  x16_mm_team(1, M, N, K, x, (const uint8_t*)q, d, NULL, scratch, y);
}

/* Row n of W as float32 (K values), the embedding's lookup. int4: its nibbles of each
   pair, the low plane's 4 values then the high plane's, times d plus m; int8 (m NULL):
   chunk j's 4 bytes, values 4j .. 4j+3, times d. */
static inline void x16_row(int K, const uint8_t* q, const uint16_t* d, const uint16_t* m, int64_t n, float* out) {
  const int G = K / 32, i = (int)(n % X16);
  const int64_t b = n / X16;
  const __m128i m4 = _mm_set1_epi8(15);
  for (int g = 0; g < G; g++) {
    const float dv = h2f(d[(b * G + g) * 16 + i]);
    const __m256 dg = _mm256_set1_ps(dv);
    if (!m) {
      const int8_t* qg = (const int8_t*)q + (b * G + g) * 2 * X16_BYTES + 4 * i;
      for (int j = 0; j < 8; j++)
        for (int c = 0; c < 4; c++) out[g * 32 + 4 * j + c] = (float)qg[64 * j + c] * dv;
      continue;
    }
    const uint8_t* qg = q + (b * G + g) * X16_BYTES + 4 * i;
    const __m256 mg = _mm256_set1_ps(h2f(m[(b * G + g) * 16 + i]));
    for (int p = 0; p < 4; p++) {
      __m128i raw = _mm_cvtsi32_si128(*(const int32_t*)(qg + 64 * p));
      __m128i v = _mm_unpacklo_epi32(_mm_and_si128(raw, m4), _mm_and_si128(_mm_srli_epi16(raw, 4), m4));
      __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
      _mm256_storeu_ps(out + g * 32 + 8 * p, _mm256_fmadd_ps(w, dg, mg));
    }
  }
}

/* Rows ids[0 .. count) as float32 (out [count][K]): the embedding's lookup (m NULL: int8). */
void int4x16_rows(int count, const int64_t* ids, int K, const uint8_t* q, const uint16_t* d, const uint16_t* m,
                  float* out) {
  #pragma omp parallel for schedule(static) if (count >= 64)
  for (int r = 0; r < count; r++) x16_row(K, q, d, m, ids[r], out + (int64_t)r * K);
}
