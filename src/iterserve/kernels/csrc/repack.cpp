// GGUF's blocks -> the tile layouts of blocks.h, once at load, and back to values.
//
// `repack_gguf` reads a tensor's bytes as the file stores them (rows of GGUF blocks) and writes
// its tiles (gguf_repack.h), tiles split among threads. One pass, no intermediate tensor; the
// Python side reads the file a slice of rows at a time into it (model/gguf_blocks.py), so a
// load never holds a tensor twice.
//
// `dequantize_rows` goes the other way, through the kernels' own decoders: the rows' weights as
// the kernels multiply them (tests hold them to the `gguf` package's dequantizer), for the
// embedding lookup of a table kept in blocks and for formats that must be dense.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "blocks.h"
#include "gguf_repack.h"
#include "ops.h"

#include <cstring>
#include <optional>

namespace iterserve {

using at::Tensor;

// raw: [N, K / inputs * block_bytes] uint8, the file's rows. rows: which source row each output
// row takes (-1 or past N: zeros), else all N rows and zero rows up to a multiple of 16.
// Writes into `out` ([rows/16, tile bytes] uint8) from tile `first_tile` on, so a caller can
// fill one output a slice of rows at a time.
void repack_gguf(const Tensor& raw, int64_t format, int64_t K, const std::optional<Tensor>& rows,
                 Tensor& out, int64_t first_tile) {
  const auto f = static_cast<Format>(format);
  const int64_t inputs = unit_inputs(f), block_bytes = gguf_block_bytes(f);
  TORCH_CHECK(inputs > 0 && block_bytes > 0, "repack_gguf: not a block format: ", format);
  TORCH_CHECK(K % inputs == 0, "repack_gguf: rows of ", K, " inputs are not whole blocks of ",
              inputs);
  const int64_t units = K / inputs, row_bytes = units * block_bytes;
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.size(1) == row_bytes &&
                  raw.stride(1) == 1,
              "repack_gguf: raw must be [N, ", row_bytes, "] uint8 rows");
  const int64_t N = raw.size(0);
  const int64_t out_rows = rows ? rows->numel() : (N + kTile - 1) / kTile * kTile;
  TORCH_CHECK(out_rows % kTile == 0, "repack_gguf: ", out_rows, " rows are not whole tiles");
  const int64_t tiles = out_rows / kTile, bytes = tile_bytes(f, K);
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kByte && out.size(1) == bytes &&
                  out.is_contiguous() && first_tile >= 0 && first_tile + tiles <= out.size(0),
              "repack_gguf: out must be [>= ", first_tile + tiles, ", ", bytes, "] uint8");
  std::optional<Tensor> index;
  if (rows) index = rows->to(at::kLong).contiguous();
  const int64_t* row_of = index ? index->data_ptr<int64_t>() : nullptr;
  const uint8_t* src = raw.data_ptr<uint8_t>();
  const int64_t ld = raw.stride(0);
  uint8_t* dst = out.data_ptr<uint8_t>() + first_tile * bytes;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) repack_tile(f, src, ld, N, row_of, K, t, dst + t * bytes);
  });
}

// Rows `rows` of a tile-laid weight ([tiles, bytes] uint8) as values: fp32, or bf16.
Tensor dequantize_rows(const Tensor& tiles, int64_t format, int64_t K, const Tensor& rows,
                       bool bf16_out) {
  const auto f = static_cast<Format>(format);
  TORCH_CHECK(tiles.dim() == 2 && tiles.scalar_type() == at::kByte && tiles.is_contiguous() &&
                  tiles.size(1) == tile_bytes(f, K),
              "dequantize_rows: tiles must be [tiles, ", tile_bytes(f, K), "] uint8");
  const Tensor index = rows.to(at::kLong).contiguous();
  const int64_t n = index.numel(), bytes = tiles.size(1), max_row = tiles.size(0) * kTile;
  const int64_t* row_of = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(row_of[i] >= 0 && row_of[i] < max_row, "dequantize_rows: row ", row_of[i],
                " is out of range (", max_row, " rows)");
  Tensor out = at::empty({n, K}, tiles.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  const uint8_t* base = tiles.data_ptr<uint8_t>();
  auto put = [&](int64_t i, int64_t k, const float* values, int count) {
    if (bf16_out) {
      at::BFloat16* o = out.data_ptr<at::BFloat16>() + i * K + k;
      for (int c = 0; c < count; ++c) o[c] = at::BFloat16(values[c]);
    } else {
      std::memcpy(out.data_ptr<float>() + i * K + k, values, count * sizeof(float));
    }
  };
  if (f == Format::kBf16 || f == Format::kF16) {
    // [K/2, 16, 2] bf16 pairs, or [K/2, 2, 16] fp16.
    at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> row(K);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t = row_of[i] / kTile, j = row_of[i] % kTile;
        for (int64_t k = 0; k < K; k += 2)
          for (int e = 0; e < 2; ++e) {
            if (f == Format::kBf16)
              row[k + e] = static_cast<float>(reinterpret_cast<const at::BFloat16*>(
                  base + t * bytes)[k * kTile + 2 * j + e]);
            else
              row[k + e] = static_cast<float>(reinterpret_cast<const at::Half*>(
                  base + t * bytes)[k * kTile + e * kTile + j]);
          }
        put(i, 0, row.data(), static_cast<int>(K));
      }
    });
    return out;
  }
  TORCH_CHECK(with_codec(f, [&](auto) {}), "dequantize_rows: unknown format ", format);
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(K);
    for (int64_t i = begin; i < end; ++i) {
      decode_row(f, base + row_of[i] / kTile * bytes, K, static_cast<int>(row_of[i] % kTile),
                 row.data());
      put(i, 0, row.data(), static_cast<int>(K));
    }
  });
  return out;
}

// (inputs a unit, bytes a tile-unit, GGUF bytes a block) of a format, for the Python side to
// check its table against.
std::tuple<int64_t, int64_t, int64_t> format_sizes(int64_t format) {
  const auto f = static_cast<Format>(format);
  const int64_t inputs = f == Format::kBf16 || f == Format::kF16 ? 2 : unit_inputs(f);
  return {inputs, inputs > 0 ? tile_bytes(f, inputs) : -1, gguf_block_bytes(f)};
}

}  // namespace iterserve
