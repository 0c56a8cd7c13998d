"""Our ops as torch custom ops for compiled graphs, and plain calls everywhere else.

A compiled graph must see paged attention, the tensor-parallel all-reduce and fbgemm's int8 GEMM as opaque ops
(torch.library.custom_op). Called eagerly through the op, though, each call pays the op's Python dispatch, and
the first one imports torch._dynamo (the op's implementation is wrapped in a lazy dynamo.disable): 1.8 s of
every eager server start, in the middle of loading the model (measured). So eager calls go straight to
the function, and only a graph being traced gets the op.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch


def custom_op(name: str, mutates_args: Sequence[str] = ()) -> Callable:
    """Like torch.library.custom_op; the result also has `.op` (the registered op) and `.register_fake`."""

    def wrap(fn: Callable) -> Callable:
        op = torch.library.custom_op(name, mutates_args=tuple(mutates_args))(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling():
                return op(*args, **kwargs)
            return fn(*args, **kwargs)

        call.op = op
        call.register_fake = op.register_fake
        return call

    return wrap
