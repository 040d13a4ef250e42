/* The read floor's probe (tools/read_floor.py): sum n floats at p, each thread its share
   read as `streams` sequential streams at once (1-8), prefetched as the kernels' weights
   are (groups.c). A one-row step's products read several streams a thread; torch's sum
   reads one, and on some machines one stream a thread does not reach the memory's rate. */
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>

float read_streams(const float* p, int64_t n, int streams) {
  float total = 0.0f;
  #pragma omp parallel reduction(+:total)
  {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    int64_t lo = n * t / T / 64 * 64, hi = t == T - 1 ? n : n * (t + 1) / T / 64 * 64;
    int64_t len = (hi - lo) / streams / 32 * 32;
    __m256 acc[8][4];
    for (int s = 0; s < 8; s++) for (int v = 0; v < 4; v++) acc[s][v] = _mm256_setzero_ps();
    for (int64_t i = 0; i < len; i += 32)
      for (int s = 0; s < streams; s++) {
        const float* q = p + lo + s * len + i;
        _mm_prefetch((const char*)q + 256, _MM_HINT_NTA);
        _mm_prefetch((const char*)q + 320, _MM_HINT_NTA);
        for (int v = 0; v < 4; v++) acc[s][v] = _mm256_add_ps(acc[s][v], _mm256_loadu_ps(q + 8 * v));
      }
    for (int64_t i = lo + streams * len; i < hi; i++) total += p[i];
    float out[8];
    for (int s = 0; s < streams; s++) for (int v = 0; v < 4; v++) {
      _mm256_storeu_ps(out, acc[s][v]);
      for (int j = 0; j < 8; j++) total += out[j];
    }
  }
  return total;
}
