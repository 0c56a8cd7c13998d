// The AMX int8 GEMM's grouped form (amx_int8.cpp), for callers that consume a GEMM's outputs in place of storing
// them: the fused decoder's prefill runs SiLU(gate) * up on each pair of 32 gate and 32 up columns while they are in
// L1 (a 1,024-token prompt's [T, 2 I] gate_up output is 12 MB a layer in the 0.6B shape: written, then read back
// from memory by a separate pass).
#pragma once
#include <torch/extension.h>

#include <cstdint>
#include <functional>
#include <vector>

// epi(g, m0, rows, out, ld): group g's outputs for activation rows [m0, m0 + rows): out[r * ld + 32 j + i] is row
// m0 + r's output of weight row block_rows[g * per_group + j] + i, rounded to T as amx_int8_linear rounds it.
template <typename T>
using AmxEpilogue = std::function<void(int64_t, int64_t, int64_t, const T*, int64_t)>;

// x [M, K] (row-major) against the AMX-packed int8 weight (quant/int8_gemm.py pack_amx) and its float32 row scales,
// over groups of per_group 32-row blocks (block_rows: each block's first weight row, a multiple of 32, the block
// whole within the weight's rows). Same sums and roundings as amx_int8_linear. Needs amx_int8_available().
template <typename T>
void amx_int8_grouped(const T* x, int64_t M, int64_t K, const at::Tensor& packed, const at::Tensor& w_scale,
                      const std::vector<int64_t>& block_rows, int64_t per_group, const AmxEpilogue<T>& epi);

// float64 models (no int8 path takes them) never reach it; declared so the fused decoder's double instantiation links.
template <>
void amx_int8_grouped<double>(const double* x, int64_t M, int64_t K, const at::Tensor& packed,
                              const at::Tensor& w_scale, const std::vector<int64_t>& block_rows, int64_t per_group,
                              const AmxEpilogue<double>& epi);
