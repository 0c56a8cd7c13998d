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

// Whether the kernels issue it: on by default; set_stream_prefetch(false) turns it off, which the loader does
// where a pass over the model's weights measures faster without (layers/prefetch_tune.py): on an Intel Xeon
// whose L3 is a victim cache, non-temporal lines skip L3, and a model that fits there was re-read from memory
// every step (the bundled model 1.6x slower); a model larger than the caches decoded the same either way.
inline bool& stream_prefetch_enabled() {
  static bool on = true;
  return on;
}

inline void prefetch_stream(const void* p) {  // locality 0: PREFETCHNTA on x86
  if (stream_prefetch_enabled()) __builtin_prefetch(p, 0, 0);
}
