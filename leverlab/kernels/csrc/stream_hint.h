// How the streaming kernels read weights that a decode step uses once: a software prefetch ahead of the loads,
// of a kind chosen per model at load (layers/prefetch_tune.py), because the best kind depends on the machine.
//
// A decode step streams every weight once. Four ways to read that stream, each the best somewhere:
//  - non-temporal (PREFETCHNTA, 1 KB ahead; the int4/int6 panels 4 KB): lines come in marked for early eviction,
//    so a stream larger than the caches does not displace the rest of the step's working set (the engine's Python,
//    the KV cache, the activations): 8-20% faster per decode step on a Zen 3 (scripts/profile_step.py, interleaved
//    runs).
//  - ahead (PREFETCHT0, 4 KB ahead): on an Intel Xeon (Sapphire/Emerald Rapids) the quantized kernels
//    had stalled on memory for every line, their arithmetic and the memory stream taking turns instead of
//    overlapping: one core read int4 weights at 7.6 GB/s without a prefetch, 8.2 non-temporally and 12.3 with
//    T0 4 KB ahead, of the 14.6 GB/s it reads with torch.sum (a standalone harness over 120 MB of 4096 x 1024
//    int4 matrices). 1 KB ahead gave 10.6, 8 KB 12.5.
//  - off: on that same Xeon, whose L3 is a victim cache, non-temporal lines skip L3, and a model that fits
//    there was re-read from memory every step (the bundled model 1.6x slower with NTA). And on a
//    Zen 4 the hardware prefetchers alone streamed fastest: a bf16 0.6B-shaped single stream
//    1.13-1.15x, int8 1.24x against nta (in one process, modes alternating).
//  - into L2 (PREFETCHT1, 4 KB ahead): on a Zen 4 decode attention read its cold KV cache 1.3-1.45x
//    faster with T1 than with T0 (paged_decode.cpp). For weights only by hand (LEVERLAB_STREAM_PREFETCH=l2): the
//    loader does not time it, since there whole int4 decodes ran slower with it than with nta although a pass
//    over the linears alone ran faster (layers/prefetch_tune.py).
// The bf16 kernel (skinny_linear.cpp) follows the mode up to 3 activation rows, instantiated per kind
// (prefetch_as below), and prefetches into L2 from 4 rows on; the quantized kernels call prefetch_stream, which
// reads the kind at each call.
//
// Each kernel family has its own mode, because one model can stream through two families whose best kinds differ:
// an int4 model's output head is int8 (quant/registry.py), and on a Zen 4 the int4 body streamed
// fastest with nta (a pass 10.8 ms, off 11.9) while the int8 head did without a prefetch (3.6 ms, nta 4.6).
#pragma once
#include <cstdint>

enum StreamPrefetch : int { kPrefetchOff = 0, kPrefetchNonTemporal = 1, kPrefetchAhead = 2, kPrefetchL2 = 3 };

// Bytes ahead of the current read, per kind: far enough to cover the memory latency at streaming rates.
constexpr int64_t kNonTemporalAhead = 1024;  // 512 B..2 KB measured alike on a Zen 3 (the int4/int6 panels: 4 KB)
constexpr int64_t kT0Ahead = 4096;
constexpr int64_t kL2Ahead = 4096;

// The kernel families, each with its own mode: the bf16 kernel, the int8 kernels (W8A8 and weight-only), int4,
// int6 (an int4 model's output head by default on AVX-512 VNNI: quant/int6.py).
enum StreamFamily : int { kStreamBf16 = 0, kStreamInt8 = 1, kStreamInt4 = 2, kStreamInt6 = 3, kStreamFamilies = 4 };

// The kind a family's kernels issue: non-temporal until the loader has measured the model (set_stream_prefetch).
inline int& stream_prefetch_mode(int family) {
  static int mode[kStreamFamilies] = {kPrefetchNonTemporal, kPrefetchNonTemporal, kPrefetchNonTemporal,
                                      kPrefetchNonTemporal};
  return mode[family];
}

// The prefetch of kind Mode for the line being read now: for a kernel instantiated per kind (the bf16 kernel), so
// that nothing is tested per line; T0Ahead, L2Ahead and NtaAhead are the kinds' distances in bytes, the caller's
// own where it measured one.
template <int Mode, int64_t T0Ahead = kT0Ahead, int64_t L2Ahead = kL2Ahead, int64_t NtaAhead = kNonTemporalAhead>
inline void prefetch_as(const void* here) {
  if constexpr (Mode == kPrefetchNonTemporal)
    __builtin_prefetch(static_cast<const char*>(here) + NtaAhead, 0, 0);
  else if constexpr (Mode == kPrefetchAhead)
    __builtin_prefetch(static_cast<const char*>(here) + T0Ahead, 0, 3);
  else if constexpr (Mode == kPrefetchL2)
    __builtin_prefetch(static_cast<const char*>(here) + L2Ahead, 0, 2);
}

// The kind measured for this model's Family kernels, read at the call: called once per 64-byte line of weights (or
// more often) at the position being read now.
template <int Family>
inline void prefetch_stream(const void* here) {
  const int mode = stream_prefetch_mode(Family);
  if (mode == kPrefetchNonTemporal)
    prefetch_as<kPrefetchNonTemporal>(here);
  else if (mode == kPrefetchAhead)
    prefetch_as<kPrefetchAhead>(here);
  else if (mode == kPrefetchL2)
    prefetch_as<kPrefetchL2>(here);
}

// Every 64-byte line of [here, here + bytes) prefetched in the kind measured for Family, the kind read once: for a
// kernel that requests a block of its stream at a time (an int4/int6 panel's group) rather than line by line.
// NtaAhead: the non-temporal kind's distance, the caller's own where it measured one.
template <int Family, int64_t NtaAhead = kNonTemporalAhead>
inline void prefetch_lines(const void* here, int64_t bytes) {
  const char* c = static_cast<const char*>(here);
  const int mode = stream_prefetch_mode(Family);
  if (mode == kPrefetchNonTemporal)
    for (int64_t i = 0; i < bytes; i += 64) prefetch_as<kPrefetchNonTemporal, kT0Ahead, kL2Ahead, NtaAhead>(c + i);
  else if (mode == kPrefetchAhead)
    for (int64_t i = 0; i < bytes; i += 64) prefetch_as<kPrefetchAhead>(c + i);
  else if (mode == kPrefetchL2)
    for (int64_t i = 0; i < bytes; i += 64) prefetch_as<kPrefetchL2>(c + i);
}
