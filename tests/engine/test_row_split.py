"""The streaming linears share a matrix's rows among the threads while they run (csrc/row_split.h: each thread
its own share front to back, then chunks from the back of another's). Which thread computes a row changes from
call to call; the row's value must not: the same bits on any number of threads, in every kernel and row count."""

import pytest
import torch

from leverlab.kernels import cpu_kernels

kern = cpu_kernels.kernels()
pytestmark = pytest.mark.skipif(kern is None, reason="no C++ kernels here")

N, K = 64 * 40 + 37, 256  # 41 chunks of 64 rows, the last one short


def _kernels():
    from leverlab.quant.layouts import (
        pack_int4_streaming,
        pack_int6_streaming,
        quantize_int4,
        quantize_int6,
        quantize_int8,
    )

    torch.manual_seed(0)
    w = torch.randn(N, K) * 0.05
    q8, s8 = quantize_int8(w)
    p4, s4 = pack_int4_streaming(*quantize_int4(w, 64), 64)
    p6, s6 = pack_int6_streaming(*quantize_int6(w, 64), 64)
    out = {
        "int8 w8a8": lambda x: kern.int8_linear(x, q8, s8, None, True),
        "int8 weight-only": lambda x: kern.int8_linear(x, q8, s8, None, False),
        "int4": lambda x: kern.int4_linear(x, p4, s4, 64, None),
        "int6": lambda x: kern.int6_linear(x, p6, s6, 64, None),
    }
    if kern.has_skinny_linear():
        wb = w.bfloat16()
        out["bf16"] = lambda x: kern.skinny_linear(x, wb, None)
    return out


@pytest.mark.parametrize("rows", [1, 4, 16])
def test_streaming_kernels_give_the_same_bits_on_any_number_of_threads(rows):
    held = torch.get_num_threads()
    x = torch.randn(rows, K).bfloat16()
    try:
        for name, linear in _kernels().items():
            torch.set_num_threads(1)
            alone = linear(x)
            for threads in (2, 3, 2, 3):  # three threads on two cores: shares finish unevenly, and get taken
                torch.set_num_threads(threads)
                assert torch.equal(linear(x), alone), (name, rows, threads)
    finally:
        torch.set_num_threads(held)
