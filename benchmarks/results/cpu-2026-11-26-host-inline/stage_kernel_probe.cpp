#include <chrono>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <vector>
#include <algorithm>
constexpr std::int32_t unstaged = -2147483647 - 1;
struct stage_layer {
  std::int32_t* staging; const std::int64_t* source; std::int64_t source_stride; std::int32_t top_k; std::int64_t items;
  void operator()(std::int32_t block, std::int32_t thread) const noexcept {
    const std::int64_t i = static_cast<std::int64_t>(block) * 256 + thread;
    if (i >= items) return;
#if VAR == 1
    const auto ii = static_cast<std::int32_t>(i);
    const std::int32_t row = ii / top_k, col = ii % top_k;
    const auto id = source[row * source_stride + col];
#elif VAR == 2
    const auto ii = static_cast<std::int32_t>(i);
    const auto id = source_stride == top_k ? source[i] : source[(ii / top_k) * source_stride + ii % top_k];
#else
    const std::int64_t row = i / top_k, col = i % top_k;
    const auto id = source[row * source_stride + col];
#endif
    constexpr std::int64_t hi = 2147483647, lo = static_cast<std::int64_t>(unstaged) + 1;
    staging[i] = static_cast<std::int32_t>(id > hi ? hi : (id < lo ? lo : id));
  }
};
template <class Op> __attribute__((noinline)) void run(std::int32_t nb, Op op) {
  for (std::int32_t b = 0; b < nb; ++b) for (std::int32_t t = 0; t < 256; ++t) op(b, t);
}
int main(int argc, char**) {
  const int rows = 1024, k = 8; const std::int64_t items = rows * k;
  std::vector<std::int64_t> src(items); for (int i = 0; i < items; ++i) src[i] = i % 128;
  std::vector<std::int32_t> staging(items * 4); std::vector<std::int64_t> snap(items);
  volatile int kk = argc > 5 ? 9 : 8;
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < 1000; ++it) run((items + 255) / 256, stage_layer{staging.data(), src.data(), kk, kk, items});
    auto t1 = std::chrono::steady_clock::now();
    for (int it = 0; it < 1000; ++it) { std::memcpy(snap.data(), src.data(), items * 8); asm volatile("" ::: "memory"); }
    auto t2 = std::chrono::steady_clock::now();
    std::printf("stage %.2f us  memcpy %.2f us\n", std::chrono::duration<double, std::micro>(t1 - t0).count() / 1000,
                std::chrono::duration<double, std::micro>(t2 - t1).count() / 1000);
  }
}
