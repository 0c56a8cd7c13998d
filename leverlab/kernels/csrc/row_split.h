// The rows of a weight matrix shared out among the threads of a streaming kernel, balanced while they run.
//
// Why: at::parallel_for gives each thread a fixed share of the rows, so each of a decode step's ~140 parallel
// regions lasts as long as its slowest share, and the shares do not take the same time (a thread that joins late,
// memory that serves one core's stream slower for a while). Measured (perf over an int4 decode of the 0.6B shape,
// two threads): the worker thread spent 24% of its time waiting in libgomp, the main thread 10%, where
// the main thread's own serial work between regions (norms, rotary, activation quantization, Python) took ~13%.
//
// Here each thread still reads its own contiguous share front to back (one sequential stream per thread, what the
// prefetchers serve best), a chunk at a time; a thread done with its share takes chunks from the back of another's,
// so the threads finish within a chunk of each other. Which thread computes a row changes from call to call, its
// value does not: every row is computed by the same code, whoever runs it.
//
// Measured on that Zen 4 (whole greedy decodes of the 0.6B shape, 128 tokens after 128, in one process with the
// two splits alternating, paired medians): bf16 1.03x, 1.09x, 1.16x; int8 1.10x, 1.04x, 1.02x; int4 1.02x, 0.96x,
// 1.04x, 0.97x (noise: the int4 body and its int6 head alone, from memory, 1.4% faster). After it the main thread
// waited 3-5% of its time, the worker 17-18%, most of that during the main thread's serial work.
#pragma once
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstdint>

namespace row_split {

constexpr int64_t kMinChunk = 64;  // rows: at::parallel_for's grain in these kernels before
constexpr int64_t kChunksPerThread = 32;  // the largest share a thread can be left waiting on: 1/32 of its own
constexpr int kMaxThreads = 64;  // shares kept on the stack; more threads than this take fixed shares

// A thread's share of chunks [front, back), both in one word, so that the owner (taking the front) and a thief
// (taking the back) agree on the last chunk with one compare-and-swap.
struct alignas(64) Share {
  std::atomic<uint64_t> span{0};

  void set(uint32_t front, uint32_t back) { span.store((uint64_t{front} << 32) | back, std::memory_order_relaxed); }

  // The next chunk from the front (owner) or the back (thief); -1 when none is left.
  int64_t take(bool from_front) {
    uint64_t s = span.load(std::memory_order_relaxed);
    for (;;) {
      const uint32_t front = static_cast<uint32_t>(s >> 32), back = static_cast<uint32_t>(s);
      if (front >= back) return -1;
      const uint64_t next = from_front ? s + (uint64_t{1} << 32) : s - 1;
      if (span.compare_exchange_weak(s, next, std::memory_order_relaxed)) return from_front ? front : back - 1;
    }
  }
};

}  // namespace row_split

// f(n0, n1) over rows [0, N) in chunks, on all of at::parallel_for's threads, as above. f must not depend on which
// thread runs it or on how [0, N) is cut, beyond chunk bounds being multiples of kMinChunk (the last one ends at N).
template <typename F>
void parallel_rows(int64_t N, const F& f) {
  using namespace row_split;
  const int64_t nt = at::get_num_threads();
  if (nt <= 1 || N <= kMinChunk || at::in_parallel_region()) return f(0, N);
  if (nt > kMaxThreads) return at::parallel_for(0, N, kMinChunk, f);
  const int64_t per = (N + nt * kChunksPerThread - 1) / (nt * kChunksPerThread);
  const int64_t chunk = std::max(kMinChunk, (per + kMinChunk - 1) / kMinChunk * kMinChunk);
  const int64_t chunks = (N + chunk - 1) / chunk;
  const int64_t shares = std::min(nt, chunks);
  Share share[kMaxThreads];
  for (int64_t t = 0; t < shares; ++t)
    share[t].set(static_cast<uint32_t>(t * chunks / shares), static_cast<uint32_t>((t + 1) * chunks / shares));
  auto run = [&](Share& s, bool from_front) {
    for (int64_t c; (c = s.take(from_front)) >= 0;) f(c * chunk, std::min(N, (c + 1) * chunk));
  };
  at::parallel_for(0, shares, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) run(share[t], true);  // this thread's own share (or more, with fewer threads)
    for (int64_t k = 1; k < shares; ++k) run(share[(t0 + k) % shares], false);  // then what the others have left
  });
}
