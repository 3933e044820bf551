// The tensor-parallel ranks' all-gather through shared memory (parallel/shm_gather.py): on one
// machine, a few microseconds where gloo's loopback TCP takes about a millisecond.
//
// Region layout: one 64-byte line per rank holding its last posted sequence number, then two
// buffers (alternating with the sequence's parity) of one slot per rank. A rank copies its rows
// into its slot of buffer seq % 2 and then publishes seq (release); a reader waits until every
// rank published seq (acquire) and copies every slot out. Two buffers suffice: a rank posts
// into buffer seq % 2 again only at seq + 2, after every rank published seq + 1, which each
// does only once it has copied call seq's slots out.
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstring>

#include "cpu_ext.h"

namespace pdserve {
namespace {

constexpr int64_t kLine = 64;

std::atomic<int64_t>* flag(uint8_t* base, int64_t rank) {
  return reinterpret_cast<std::atomic<int64_t>*>(base + rank * kLine);
}

uint8_t* slot(uint8_t* base, int64_t size, int64_t slot_bytes, int64_t seq, int64_t rank) {
  return base + size * kLine + ((seq % 2) * size + rank) * slot_bytes;
}

void check_region(const at::Tensor& region, int64_t size, int64_t slot_bytes) {
  TORCH_CHECK(region.scalar_type() == at::kByte && region.is_contiguous() &&
                  region.numel() >= size * kLine + 2 * size * slot_bytes,
              "shm gather: region too small for ", size, " ranks of ", slot_bytes, " bytes");
}

}  // namespace

void shm_post(const at::Tensor& region, const at::Tensor& x, int64_t rank, int64_t size,
              int64_t seq, int64_t slot_bytes) {
  check_region(region, size, slot_bytes);
  TORCH_CHECK(x.is_contiguous() && x.nbytes() <= static_cast<size_t>(slot_bytes),
              "shm gather: rows must be contiguous and fit a slot");
  uint8_t* base = region.data_ptr<uint8_t>();
  std::memcpy(slot(base, size, slot_bytes, seq, rank), x.data_ptr(), x.nbytes());
  flag(base, rank)->store(seq, std::memory_order_release);
}

bool shm_wait_gather(const at::Tensor& region, const at::Tensor& out, int64_t size, int64_t seq,
                     int64_t slot_bytes, double wait_s) {
  check_region(region, size, slot_bytes);
  TORCH_CHECK(out.is_contiguous() && out.size(0) == size &&
                  out.nbytes() / size <= static_cast<size_t>(slot_bytes),
              "shm gather: out must be (ranks, ...) rows that fit a slot");
  uint8_t* base = region.data_ptr<uint8_t>();
  const auto start = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < size; ++r) {
    for (int64_t spins = 0; flag(base, r)->load(std::memory_order_acquire) < seq; ++spins) {
      if (spins < 4096) {
        _mm_pause();
        continue;
      }
      // A peer is still computing: stop burning the core it may need, and give up after
      // wait_s so the caller can check that the peer is alive.
      sched_yield();
      if ((spins & 255) == 0 && std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                                               start).count() > wait_s) {
        return false;
      }
    }
  }
  const size_t row_bytes = out.nbytes() / size;
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  for (int64_t r = 0; r < size; ++r) {
    std::memcpy(dst + r * row_bytes, slot(base, size, slot_bytes, seq, r), row_bytes);
  }
  return true;
}

}  // namespace pdserve
