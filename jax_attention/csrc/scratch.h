// The kernel's one way to get working memory: Scratch(slot, n), n floats, 64-byte aligned,
// not initialised.
//
// Up to kKeptScratch floats a slot, the memory is the calling thread's own and is kept
// between calls, so that a training step's calls reuse the same pages: freed each time,
// the allocator hands large blocks back to the operating system and every call faults
// them in again.  Larger requests get memory of their own, freed when the Scratch goes:
// their work dwarfs the page faults, and each of XLA's threads keeping tens of MiB would
// only grow the process.
//
// A slot is one buffer a thread: two Scratch objects alive at once on one thread (a
// caller holding its packed operands while it runs tasks of its own parallel loop) must
// name different slots.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>

namespace twin {

enum Slot : int {
  kForwardK,        // the forward's packed keys (the calling thread, for the whole call)
  kForwardV,        // the forward's packed values (likewise)
  kForwardBlock,    // a forward task's queries, scores and running sums
  kBackwardUnit,    // a backward task's packed operands and tiles
  kBackwardParts,   // the backward's partial dQ sums (the calling thread)
  kGemmA,           // the matmul's packed rows of a transposed A (a task)
  kGemmB,           // a task's packed panels of B
  kGemmSharedB,     // all of B, packed once and shared by the tasks (the calling thread)
  kGemmEdge,        // a task's packed last, partial micro-row of A
  kGemmPartial,     // the partial sums of a K split (the calling thread)
  kSlots
};

constexpr size_t kKeptScratch = size_t{4} << 20;  // floats a slot: 16 MiB

class Scratch {
 public:
  Scratch(Slot slot, size_t n) {
    thread_local Buffer kept[kSlots];
    if (n > kKeptScratch) {
      own_ = allocate(n);
      data_ = own_.get();
      return;
    }
    Buffer& buffer = kept[slot];
    if (buffer.size < n) {
      buffer.data.reset();
      buffer.data = allocate(n);
      buffer.size = n;
    }
    data_ = buffer.data.get();
  }
  float* get() const { return data_; }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  using Memory = std::unique_ptr<float[], Free>;
  struct Buffer {
    Memory data;
    size_t size = 0;
  };
  static Memory allocate(size_t n) {
    const size_t bytes = (n * sizeof(float) + 63) / 64 * 64;  // aligned_alloc: a multiple of 64
    void* p = std::aligned_alloc(64, bytes == 0 ? 64 : bytes);
    if (p == nullptr) throw std::bad_alloc();
    return Memory(static_cast<float*>(p));
  }
  Memory own_;
  float* data_;
};

}  // namespace twin
