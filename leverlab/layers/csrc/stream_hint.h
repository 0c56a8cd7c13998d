// How the streaming kernels read weights that a decode step uses once: a non-temporal prefetch a little ahead.
//
// A decode step streams every weight once, and on a small model that stream is larger than the caches, so with
// plain loads it evicts everything else each step: the engine's Python, the KV cache, the activations. Each step
// then starts cold (measured on a Zen 3: argmax over 8K logits took ~40 us inside a step against ~10 us hot).
// PREFETCHNTA brings a line in marked for early eviction, so the weights pass through without displacing the
// rest: 8-20% faster per decode step on the bundled model (scripts/profile_step.py, interleaved runs), where a
// T0 prefetch at the same distances had measured 3-5% slower than none.
#pragma once
#include <cstdint>

// Bytes ahead of the current read: far enough to cover the memory latency at streaming rates, close enough to stay
// inside the hardware prefetcher's window (512 B..2 KB measured alike; 1 KB chosen).
constexpr int64_t kStreamAhead = 1024;

// Whether the kernels issue it: on by default; off by set_stream_prefetch(false) (LEVERLAB_NO_STREAM_PREFETCH=1),
// for A/B runs in one process. On an AVX-512 Xeon (2 threads, Qwen3-0.6B shape, int4) decode measured the same
// either way (1.01x), though matrices hot in its 260 MB L3 read up to 1.5x faster without it in isolation.
inline bool& stream_prefetch_enabled() {
  static bool on = true;
  return on;
}

inline void prefetch_stream(const void* p) {  // locality 0: PREFETCHNTA on x86
  if (stream_prefetch_enabled()) __builtin_prefetch(p, 0, 0);
}
