// What an instruction costs the many-row loops (kernels/csrc/tiles.h `sweep_tiles`), whose
// pace is set by the VNNI dot products: 8 independent `vpdpbusd zmm` a loop, alone and then
// beside 4 of another instruction, in cycles a loop. An instruction that adds nothing runs
// on other pipes (or ports); one that adds a cycle each shares the dot products' pipe. The
// clock is taken from a chain of dependent adds (one a cycle), so the cycles are the core's
// as it runs, turbo included. AVX-512 VNNI only (x86-64); run pinned, on an idle core.
//
//   g++ -O2 -mavx512f -mavx512vnni -o /tmp/pipe_costs benchmarks/pipe_costs.cpp
//   taskset -c 1 /tmp/pipe_costs
#include <chrono>
#include <cstdint>
#include <cstdio>

namespace {

constexpr long kLoops = 50'000'000;

template <typename F>
double seconds(F&& f) {
  const auto start = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Cycles a second: a chain of dependent adds retires one a cycle.
double clock_hz() {
  const long n = 400'000'000;
  uint64_t x = 0;
  const double s = seconds([&] {
    for (long i = 0; i < n; ++i) asm volatile("add $1, %0" : "+r"(x));
  });
  return n / s;
}

// Eight dot products into zmm0-7 (independent chains), then EXTRA.
#define DOTS                                  \
  "vpdpbusd %%zmm30, %%zmm31, %%zmm0\n"       \
  "vpdpbusd %%zmm30, %%zmm31, %%zmm1\n"       \
  "vpdpbusd %%zmm30, %%zmm31, %%zmm2\n"       \
  "vpdpbusd %%zmm30, %%zmm31, %%zmm3\n"       \
  "vpdpbusd %%zmm30, %%zmm31, %%zmm4\n"       \
  "vpdpbusd %%zmm30, %%zmm31, %%zmm5\n"       \
  "vpdpbusd %%zmm30, %%zmm31, %%zmm6\n"       \
  "vpdpbusd %%zmm30, %%zmm31, %%zmm7\n"
#define CLOBBERS                                                                          \
  "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm10", \
      "xmm11", "xmm12", "xmm13"
#define FOUR(op) op(10) op(11) op(12) op(13)

#define CASE(name, extra)                                                              \
  {                                                                                   \
    alignas(64) int buf[64] = {};                                                     \
    const double s = seconds([&] {                                                    \
      for (long i = 0; i < kLoops; ++i) asm volatile(DOTS extra ::"r"(buf) : CLOBBERS); \
    });                                                                               \
    std::printf("%-34s %5.1f cycles a loop\n", name, s * hz / kLoops);                \
  }

#define MULLD(r) "vpmulld %%zmm8, %%zmm30, %%zmm" #r "\n"
#define PADDD(r) "vpaddd %%zmm8, %%zmm30, %%zmm" #r "\n"
#define CVT(r) "vcvtdq2ps %%zmm8, %%zmm" #r "\n"
#define FMA(r) "vfmadd231ps %%zmm8, %%zmm30, %%zmm" #r "\n"
#define MULPS(r) "vmulps %%zmm8, %%zmm30, %%zmm" #r "\n"
#define ADDPS(r) "vaddps %%zmm8, %%zmm30, %%zmm" #r "\n"
#define DPWSSD(r) "vpdpwssd %%zmm8, %%zmm30, %%zmm" #r "\n"
#define MADDWD(r) "vpmaddwd %%zmm8, %%zmm30, %%zmm" #r "\n"
#define TERNLOG(r) "vpternlogd $0xea, %%zmm8, %%zmm30, %%zmm" #r "\n"
#define SRLD(r) "vpsrld $4, %%zmm8, %%zmm" #r "\n"
#define ANDD(r) "vpandd %%zmm8, %%zmm30, %%zmm" #r "\n"
#define LOAD(r) "vmovdqa32 " #r "*64-640(%0), %%zmm" #r "\n"
#define BCAST(r) "vpbroadcastd " #r "*4(%0), %%zmm" #r "\n"
#define ZXBD(r) "vpmovzxbd " #r "*16(%0), %%zmm" #r "\n"
#define STORE(r) "vmovdqa32 %%zmm30, " #r "*64-640(%0)\n"

}  // namespace

int main() {
  const double hz = clock_hz();
  std::printf("clock %.2f GHz (dependent adds)\n", hz / 1e9);
  CASE("8 vpdpbusd", "")
  CASE("+ 4 vfmadd231ps", FOUR(FMA))
  CASE("+ 4 vmulps", FOUR(MULPS))
  CASE("+ 4 vpmulld", FOUR(MULLD))
  CASE("+ 4 vpdpwssd", FOUR(DPWSSD))
  CASE("+ 4 vpmaddwd", FOUR(MADDWD))
  CASE("+ 4 vcvtdq2ps", FOUR(CVT))
  CASE("+ 4 vaddps", FOUR(ADDPS))
  CASE("+ 4 vpaddd", FOUR(PADDD))
  CASE("+ 4 vpandd", FOUR(ANDD))
  CASE("+ 4 vpsrld", FOUR(SRLD))
  CASE("+ 4 vpternlogd", FOUR(TERNLOG))
  CASE("+ 4 loads (zmm)", FOUR(LOAD))
  CASE("+ 4 vpbroadcastd from memory", FOUR(BCAST))
  CASE("+ 4 vpmovzxbd from memory", FOUR(ZXBD))
  CASE("+ 4 stores (zmm)", FOUR(STORE))
  return 0;
}
