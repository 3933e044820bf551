// GGUF block bytes (one row of blocks per output column) -> the packed panels of
// quant_layout.h. Runs once per weight at load; plain scalar code, parallel over panels.
#include <algorithm>
#include <cstring>

#include "quant_layout.h"

namespace pdserve {
namespace {

using namespace quant;

inline uint16_t u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
inline void put16(uint8_t* p, int64_t i, uint16_t v) { std::memcpy(p + 2 * i, &v, 2); }

// Column c's quant q (0..15) at k in a 4-bit plane.
inline void put_nibble(uint8_t* plane, int64_t k, int64_t c, int q) {
  plane[k * 8 + (c & 7)] |= static_cast<uint8_t>((q & 0x0F) << ((c >> 3) * 4));
}

// GGML's get_scale_min_k4: the 6-bit scale and min of Q4_K/Q5_K sub-block j.
inline void scale_min_k4(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q4_K/Q5_K: d, dmin, scales and mins of column c; the low 4 bits of element e are
// (qs[32 * (e / 64) + e % 32] >> (4 * ((e / 32) % 2))) & 15.
inline void put_kquant(const uint8_t* raw, const uint8_t* qs, uint8_t* rec, int64_t c) {
  put16(rec, c, u16(raw));
  put16(rec, 16 + c, u16(raw + 2));
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    scale_min_k4(raw + 4, j, sc, m);
    rec[64 + j * 16 + c] = static_cast<uint8_t>(sc);
    rec[192 + j * 16 + c] = static_cast<uint8_t>(m);
  }
  for (int e = 0; e < 256; ++e) {
    const int q = qs[32 * (e / 64) + e % 32] >> (4 * ((e / 32) % 2));
    put_nibble(rec + kKQuantNibbles, e, c, q);
  }
}

// Writes column c's GGUF block `raw` into the (zeroed) record `rec`.
void put_column(int64_t type, const uint8_t* raw, uint8_t* rec, int64_t c) {
  switch (type) {
    case F32:
      for (int64_t k = 0; k < 32; ++k) std::memcpy(rec + (k * kPanel + c) * 4, raw + k * 4, 4);
      break;
    case F16: case BF16:
      for (int64_t k = 0; k < 32; ++k) put16(rec, k * kPanel + c, u16(raw + 2 * k));
      break;
    case Q8_0:
      put16(rec, c, u16(raw));
      for (int64_t k = 0; k < 32; ++k) rec[32 + k * kPanel + c] = raw[2 + k];
      break;
    case Q4_0: case Q4_1: {
      const int64_t header = type == Q4_0 ? 2 : 4;
      put16(rec, c, u16(raw));
      if (type == Q4_1) put16(rec, 16 + c, u16(raw + 2));
      for (int64_t k = 0; k < 32; ++k)
        put_nibble(rec + header * 16, k, c, raw[header + k % 16] >> (4 * (k / 16)));
      break;
    }
    case Q5_0: case Q5_1: {
      // d (, m), qh (uint32: bit j is element j's fifth bit), qs[16] as Q4_0.
      const int64_t header = type == Q5_0 ? 2 : 4, scales = header / 2 * 32;
      put16(rec, c, u16(raw));
      if (type == Q5_1) put16(rec, 16 + c, u16(raw + 2));
      uint32_t qh;
      std::memcpy(&qh, raw + header, 4);
      uint16_t* high = reinterpret_cast<uint16_t*>(rec + scales + 256);
      for (int64_t k = 0; k < 32; ++k) {
        put_nibble(rec + scales, k, c, raw[header + 4 + k % 16] >> (4 * (k / 16)));
        high[k] = static_cast<uint16_t>(high[k] | (((qh >> k) & 1) << c));
      }
      break;
    }
    case Q4_K: put_kquant(raw, raw + 16, rec, c); break;
    case Q5_K: {
      const uint8_t* qh = raw + 16;
      put_kquant(raw, raw + 48, rec, c);
      uint16_t* high = reinterpret_cast<uint16_t*>(rec + kQ5High);
      for (int e = 0; e < 256; ++e) {
        const int bit = (qh[e % 32] >> (e / 32)) & 1;  // bit 2i / 2i+1 for 64i + (0 | 32) + l
        high[e] = static_cast<uint16_t>(high[e] | (bit << c));
      }
      break;
    }
    case Q6_K: {
      // ql[128], qh[64], sc[16] int8, d. Element 128h + 32r + l (r = 0..3, l < 32): low
      // nibble of ql[64h + l + 32 (r % 2)] (high nibble for r >= 2), high bits
      // (qh[32h + l] >> 2r) & 3.
      put16(rec, c, u16(raw + 208));
      for (int j = 0; j < 16; ++j) rec[32 + j * 16 + c] = raw[192 + j];
      uint32_t* high = reinterpret_cast<uint32_t*>(rec + kQ6High);
      for (int e = 0; e < 256; ++e) {
        const int h = e / 128, r = (e % 128) / 32, l = e % 32;
        const int lo = raw[64 * h + l + 32 * (r % 2)] >> (4 * (r / 2));
        put_nibble(rec + kQ6Nibbles, e, c, lo);
        high[e] |= static_cast<uint32_t>((raw[128 + 32 * h + l] >> (2 * r)) & 3) << (2 * c);
      }
      break;
    }
    default: TORCH_CHECK(false, "quantized matmul: unsupported GGML type ", type);
  }
}

}  // namespace

// (N, bytes_per_row) uint8 GGUF blocks of `type` -> (ceil(N/16), K / block_k, record_bytes)
// uint8 panels; columns past N are zero (their weights unpack to 0).
at::Tensor quant_pack(const at::Tensor& data, int64_t type, int64_t K) {
  const Layout lay = layout_of(type);
  TORCH_CHECK(data.dim() == 2 && data.scalar_type() == at::kByte && data.is_contiguous(),
              "quant_pack: (N, bytes_per_row) contiguous uint8");
  TORCH_CHECK(K > 0 && K % lay.block_k == 0, "quant_pack: K=", K, " is not a multiple of ",
              lay.block_k);
  const int64_t blocks = K / lay.block_k, N = data.size(0);
  TORCH_CHECK(data.size(1) == blocks * lay.raw_bytes, "quant_pack: rows of ", data.size(1),
              " bytes, expected ", blocks * lay.raw_bytes);
  const int64_t panels = (N + kPanel - 1) / kPanel;
  auto packed = empty_in_huge_pages({panels, blocks, lay.record_bytes}, data.options());
  const uint8_t* src = data.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      uint8_t* panel = dst + p * blocks * lay.record_bytes;
      std::memset(panel, 0, blocks * lay.record_bytes);
      for (int64_t c = 0; c < std::min(kPanel, N - p * kPanel); ++c) {
        const uint8_t* row = src + (p * kPanel + c) * data.size(1);
        for (int64_t b = 0; b < blocks; ++b)
          put_column(type, row + b * lay.raw_bytes, panel + b * lay.record_bytes, c);
      }
    }
  });
  return packed;
}

}  // namespace pdserve
