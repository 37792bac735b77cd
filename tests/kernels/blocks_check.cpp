// The block formats' kernels (csrc/gguf_repack.h, blocks.h, tiles.h) as a standalone program,
// for the ISA variants where no torch build is at hand to load the kernels themselves: Arm64
// under qemu-user (tests/kernels/test_block_formats.py builds it for every variant it can
// run). The same repacking, decoding and loops as the kernels; only the driver is this file.
//
// stdin, little-endian: int32 cases, then per case int32 format, N, K, M, the weight's GGUF
// bytes [N rows of K / inputs blocks] and the activations [M, K] as bf16 bits.
// stdout, per case, float32: the N rows decoded ([N, K]), the M rows' products in one step
// ([M, N_pad]: the sweep when M > 4), then each row's alone ([M, N_pad], a one-row stream).

#include "gguf_repack.h"
#include "tiles.h"

#include <cstdio>
#include <vector>

using namespace iterserve;

namespace {

template <typename T>
T read_one() {
  T value;
  if (std::fread(&value, sizeof(T), 1, stdin) != 1) std::exit(2);
  return value;
}

template <typename T>
std::vector<T> read_many(size_t count) {
  std::vector<T> values(count);
  if (count && std::fread(values.data(), sizeof(T), count, stdin) != count) std::exit(2);
  return values;
}

void write(const std::vector<float>& values) {
  std::fwrite(values.data(), sizeof(float), values.size(), stdout);
}

// x [M, K] times the tiles: one thread's whole share, as the kernels run it.
std::vector<float> products(const Segment& seg, const at::BFloat16* x, int64_t M, int64_t K) {
  QuantizedBuffers q(M, K, unit_inputs(seg.format));
  for (int64_t m = 0; m < M; ++m) q.row(x + m * K, K, m);
  Rows rows{K, nullptr, 0, nullptr, 0, {}, {}};
  (q.view.unit == 256 ? rows.per256 : rows.per32) = q.view;
  const int64_t N = seg.tiles * kTile;
  std::vector<float> out(M * N);
  Epilogue ep{nullptr, out.data(), N, nullptr, nullptr, 0};
  segment_range(seg, rows, M, 0, seg.tiles, ep);
  return out;
}

}  // namespace

int main() {
  const int32_t cases = read_one<int32_t>();
  for (int32_t c = 0; c < cases; ++c) {
    const auto f = static_cast<Format>(read_one<int32_t>());
    const int64_t N = read_one<int32_t>(), K = read_one<int32_t>(), M = read_one<int32_t>();
    const int64_t block_bytes = gguf_block_bytes(f), inputs = unit_inputs(f);
    if (block_bytes <= 0 || K % inputs) return 3;
    const int64_t ld = K / inputs * block_bytes, bytes = tile_bytes(f, K);
    const std::vector<uint8_t> raw = read_many<uint8_t>(N * ld);
    const std::vector<uint16_t> bits = read_many<uint16_t>(M * K);
    std::vector<at::BFloat16> x(M * K);
    for (int64_t i = 0; i < M * K; ++i) x[i].x = bits[i];
    const int64_t tiles = (N + kTile - 1) / kTile;
    std::vector<uint8_t> packed(tiles * bytes);
    for (int64_t t = 0; t < tiles; ++t)
      repack_tile(f, raw.data(), ld, N, nullptr, K, t, packed.data() + t * bytes);
    std::vector<float> decoded(N * K);
    for (int64_t r = 0; r < N; ++r)
      decode_row(f, packed.data() + r / kTile * bytes, K, static_cast<int>(r % kTile),
                 decoded.data() + r * K);
    write(decoded);
    const Segment seg{f, packed.data(), bytes, tiles, 0};
    write(products(seg, x.data(), M, K));
    std::vector<float> alone;
    for (int64_t m = 0; m < M; ++m) {
      const std::vector<float> row = products(seg, x.data() + m * K, 1, K);
      alone.insert(alone.end(), row.begin(), row.end());
    }
    write(alone);
  }
  return 0;
}
