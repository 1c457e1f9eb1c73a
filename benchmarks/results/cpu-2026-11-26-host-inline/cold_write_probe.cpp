#include <chrono>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <vector>
#include <immintrin.h>
int main() {
  const size_t slab = 8192 * 8, used = 1024 * 8;  // int64 elements
  std::vector<std::int64_t> staging(48 * slab, 1), src(used, 5), junk(4 << 20, 1);
  for (int mode = 0; mode < 3; ++mode) for (int rep = 0; rep < 3; ++rep) {
    double total = 0; int n = 0;
    for (int step = 0; step < 20; ++step) {
      for (int l = 0; l < 48; ++l) {
        // the forward between layers: touches 256 KB
        for (size_t i = 0; i < 32768; i += 8) junk[(i + l * 32768) % junk.size()] += 1;
        std::int64_t* dst = staging.data() + l * slab;
        auto t0 = std::chrono::steady_clock::now();
        if (mode == 0 || mode == 2) std::memcpy(dst, src.data(), used * 8);
        else {
          for (size_t i = 0; i < used; i += 2) _mm_stream_si128((__m128i*)(dst + i), _mm_load_si128((const __m128i*)(src.data() + i)));
          _mm_sfence();
        }
        if (mode == 2) { std::int64_t* nx = staging.data() + ((l + 1) % 48) * slab; for (size_t i = 0; i < used; i += 8) __builtin_prefetch(nx + i, 1); }
        auto t1 = std::chrono::steady_clock::now();
        total += std::chrono::duration<double, std::micro>(t1 - t0).count(); ++n;
      }
    }
    std::printf("mode %d (%s): %.2f us per 64KB\n", mode, mode == 0 ? "memcpy" : mode == 1 ? "stream" : "memcpy+prefetch next", total / n);
  }
}
