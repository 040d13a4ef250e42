/* int4 weights in blocks of 16 rows times activations rounded to int8 (quant/int4x16.py):
   the int4 multiply of a decode step and of small chunks. Included by fused_decode.c
   after groups.c (h2f).

   Layout. Block b holds rows 16b .. 16b+15 (the last block padded with zero rows); group g
   of a block is 256 bytes: 4 pairs p of 64 bytes, byte k of pair p holding row 16b + k/4's
   value 8p + k%4 in its low nibble and value 8p + 4 + k%4 in its high one. So one pair's
   two nibble planes are two registers of 16 lanes (AVX-512; two halves of 8 under AVX2),
   lane i holding 4 consecutive values of row i: an integer dot product with 4 activation
   values broadcast to every lane advances 16 rows at once, and the 8 of a group sum in
   int32 before the group's scales are applied. d, m: float16 [blocks][groups][16].
   Values as in groups.c: w = q * d + m, q in 0..15.

   Activations: each row's group of 32 is rounded to int8 on its own grid, s = max|x| / 127,
   xq = round(x / s) (GGUF's Q8_1; llama.cpp multiplies Q4 weights the same way), and
     y = sum_g d_g * s_g * (q . xq)_g + m_g * s_g * sum(xq)_g,
   the dequantized weight times the rounded activations, exactly: the error is
   sum w * (s xq - x), at most sum_g s_g / 2 * sum|w|_g. (The m term over the exact sum
   of x instead weighs each rounding error by q * d, 0..15 d, rather than by w, about
   -8 d..7 d for Q4_0/Q4_1 blocks: twice the error, +1.1% perplexity on SmolLM2 against
   +0.2%.) tests/int4_oracle.py is this formula in float64.

   Why: groups.c's int4 path widens every value to a float lane and spends one FMA per
   value per activation row; here a value costs a quarter of an integer instruction per
   row (vpdpbusd: 64 products; AVX2 or AVX-512 without VNNI: vpmaddubsw + vpmaddwd) and
   the unpack is two ANDs and a shift per 128 values (docs/BENCHMARKS.md 24). */

#define X16 16        /* rows per block */
#define X16_MB 16     /* activation rows per pass over a block's groups (accumulators) */
#define X16_BYTES 256 /* bytes per block and group */

/* One activation row's groups: xq [K] int8, sc [G] = s, sum [G] = s * sum(xq). */
static void x16_quantize_row(int K, const float* x, int8_t* xq, float* sc, float* sum) {
  for (int g = 0; g < K / 32; g++) {
    const float* xg = x + g * 32;
#ifdef __AVX512F__
    __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    __m512 inv = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
    __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
    _mm_storeu_si128((__m128i*)(xq + g * 32), _mm512_cvtsepi32_epi8(qa));
    _mm_storeu_si128((__m128i*)(xq + g * 32 + 16), _mm512_cvtsepi32_epi8(qb));
    const int isum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
#else
    __m256 v[4], mx = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < 4; i++) {
      v[i] = _mm256_loadu_ps(xg + 8 * i);
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    __m256 inv = _mm256_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
    __m256i q[4];
    for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
    /* packs work within 128-bit halves: the permute puts the 8 dwords back in order */
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i*)(xq + g * 32), p);
    __m256i s4 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s2 = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
    s2 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0x4e));
    const int isum = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xb1)));
#endif
    sc[g] = amax / 127.0f;
    sum[g] = sc[g] * (float)isum;
  }
}

#ifdef __AVX512BW__
/* A block's group times `mb` activation rows (mb a constant at each call: the
   accumulators f stay in registers), out [mb][16]. */
static inline __attribute__((always_inline)) void x16_block(int G, int mb, const int8_t* xq, const float* sc,
    const float* sum, const uint8_t* qb, const uint16_t* db, const uint16_t* mbk, float* out) {
  __m512 f[X16_MB];
  const __m512i m4 = _mm512_set1_epi8(15);
  for (int r = 0; r < mb; r++) f[r] = _mm512_setzero_ps();
  for (int g = 0; g < G; g++) {
    const uint8_t* qg = qb + (int64_t)g * X16_BYTES;
    _mm_prefetch((const char*)qg + PREFETCH, _MM_HINT_T0);
    _mm_prefetch((const char*)qg + PREFETCH + 64, _MM_HINT_T0);
    __m512i w[8];
    for (int p = 0; p < 4; p++) {
      __m512i raw = _mm512_loadu_si512(qg + 64 * p);
      w[2 * p] = _mm512_and_si512(raw, m4);
      w[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
    }
    __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(db + g * 16)));
    __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(mbk + g * 16)));
    for (int r = 0; r < mb; r++) {
      const int32_t* x4 = (const int32_t*)(xq + (int64_t)r * G * 32 + g * 32);
#ifdef __AVX512VNNI__
      __m512i acc = _mm512_setzero_si512();
      for (int j = 0; j < 8; j++) acc = _mm512_dpbusd_epi32(acc, w[j], _mm512_set1_epi32(x4[j]));
#else
      /* 8 x 2 products of at most 15 * 127 each: 30,480 fits int16 (no saturation) */
      __m512i s16 = _mm512_setzero_si512();
      for (int j = 0; j < 8; j++) s16 = _mm512_add_epi16(s16, _mm512_maddubs_epi16(w[j], _mm512_set1_epi32(x4[j])));
      __m512i acc = _mm512_madd_epi16(s16, _mm512_set1_epi16(1));
#endif
      const int64_t rg = (int64_t)r * G + g;
      f[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(sc[rg])), d, f[r]);
      f[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sum[rg]), f[r]);
    }
  }
  for (int r = 0; r < mb; r++) _mm512_storeu_ps(out + r * 16, f[r]);
}
#define X16_HALVES 1
#else
/* AVX2: half h of a block (rows 8h .. 8h+7: the first or second 32 bytes of each pair),
   4 activation rows at a time (16 registers). */
static inline __attribute__((always_inline)) void x16_half(int G, int h, int mb, const int8_t* xq, const float* sc,
    const float* sum, const uint8_t* qb, const uint16_t* db, const uint16_t* mbk, float* out) {
  __m256 f[4];
  const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  for (int r = 0; r < mb; r++) f[r] = _mm256_setzero_ps();
  for (int g = 0; g < G; g++) {
    const uint8_t* qg = qb + (int64_t)g * X16_BYTES + 32 * h;
    _mm_prefetch((const char*)qg + PREFETCH, _MM_HINT_T0);
    __m256i w[8];
    for (int p = 0; p < 4; p++) {
      __m256i raw = _mm256_loadu_si256((const __m256i*)(qg + 64 * p));
      w[2 * p] = _mm256_and_si256(raw, m4);
      w[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
    }
    __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(db + g * 16 + 8 * h)));
    __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(mbk + g * 16 + 8 * h)));
    for (int r = 0; r < mb; r++) {
      const int32_t* x4 = (const int32_t*)(xq + (int64_t)r * G * 32 + g * 32);
      __m256i s16 = _mm256_setzero_si256();  /* 8 x 2 products of at most 15 * 127: fits int16 */
      for (int j = 0; j < 8; j++) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(x4[j])));
      const int64_t rg = (int64_t)r * G + g;
      __m256 v = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
      f[r] = _mm256_fmadd_ps(_mm256_mul_ps(v, _mm256_set1_ps(sc[rg])), d, f[r]);
      f[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sum[rg]), f[r]);
    }
  }
  for (int r = 0; r < mb; r++) _mm256_storeu_ps(out + r * 16 + 8 * h, f[r]);
}
#define X16_HALVES 2
#endif

/* Scratch bytes int4x16_mm needs for M activation rows of K values. */
int64_t int4x16_scratch(int M, int K) { return (int64_t)M * K + 2 * (int64_t)M * (K / 32) * sizeof(float); }

/* y[M][N] = x[M][K] W^T for W in blocks (N rows, ceil(N / 16) blocks). scratch: int4x16_scratch bytes. */
void int4x16_mm(int M, int N, int K, const float* x, const uint8_t* q, const uint16_t* d, const uint16_t* m,
                void* scratch, float* y) {
  const int G = K / 32, NB = (N + X16 - 1) / X16;
  int8_t* xq = (int8_t*)scratch;
  float* sc = (float*)(xq + (int64_t)M * K);
  float* sum = sc + (int64_t)M * G;
  #pragma omp parallel for schedule(static) if (M >= 8)
  for (int r = 0; r < M; r++)
    x16_quantize_row(K, x + (int64_t)r * K, xq + (int64_t)r * K, sc + (int64_t)r * G, sum + (int64_t)r * G);
  #pragma omp parallel for schedule(static)
  for (int b = 0; b < NB; b++) {
    const uint8_t* qb = q + (int64_t)b * G * X16_BYTES;
    const uint16_t *db = d + (int64_t)b * G * 16, *mbk = m + (int64_t)b * G * 16;
    const int rows = N - b * X16 < X16 ? N - b * X16 : X16;
    for (int r0 = 0; r0 < M; r0 += X16_MB) {
      const int mb = M - r0 < X16_MB ? M - r0 : X16_MB;
      const int8_t* xr = xq + (int64_t)r0 * K;
      const float *scr = sc + (int64_t)r0 * G, *sumr = sum + (int64_t)r0 * G;
      float out[X16_MB * 16];
#ifdef __AVX512BW__
#define MB(c) case c: x16_block(G, c, xr, scr, sumr, qb, db, mbk, out); break;
      switch (mb) { MB(1) MB(2) MB(3) MB(4) MB(5) MB(6) MB(7) MB(8) MB(9) MB(10) MB(11) MB(12) MB(13) MB(14)
                    MB(15) MB(16) }
#undef MB
#else
      for (int h = 0; h < X16_HALVES; h++)
        for (int i = 0; i < mb; i += 4) {
          const int n4 = mb - i < 4 ? mb - i : 4;
#define MB(c) case c: x16_half(G, h, c, xr + (int64_t)i * K, scr + (int64_t)i * G, sumr + (int64_t)i * G, \
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

/* Row n of W as float32 (K values): its nibbles of each pair, the low plane's 4 values
   then the high plane's, times d plus m (the embedding's lookup). */
static inline void x16_row(int K, const uint8_t* q, const uint16_t* d, const uint16_t* m, int64_t n, float* out) {
  const int G = K / 32, i = (int)(n % X16);
  const int64_t b = n / X16;
  const __m128i m4 = _mm_set1_epi8(15);
  for (int g = 0; g < G; g++) {
    const uint8_t* qg = q + (b * G + g) * X16_BYTES + 4 * i;
    const __m256 dg = _mm256_set1_ps(h2f(d[(b * G + g) * 16 + i])), mg = _mm256_set1_ps(h2f(m[(b * G + g) * 16 + i]));
    for (int p = 0; p < 4; p++) {
      __m128i raw = _mm_cvtsi32_si128(*(const int32_t*)(qg + 64 * p));
      __m128i v = _mm_unpacklo_epi32(_mm_and_si128(raw, m4), _mm_and_si128(_mm_srli_epi16(raw, 4), m4));
      __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
      _mm256_storeu_ps(out + g * 32 + 8 * p, _mm256_fmadd_ps(w, dg, mg));
    }
  }
}

/* Rows ids[0 .. count) as float32 (out [count][K]): the embedding's lookup. */
void int4x16_rows(int count, const int64_t* ids, int K, const uint8_t* q, const uint16_t* d, const uint16_t* m,
                  float* out) {
  #pragma omp parallel for schedule(static) if (count >= 64)
  for (int r = 0; r < count; r++) x16_row(K, q, d, m, ids[r], out + (int64_t)r * K);
}
