"""A CPU model's weights moved into transparent-huge-page memory, once, after loading.

Why: a decode step streams every weight once, a few hundred MB for a 0.6B model, and with 4 KB pages that is one
page walk per 4 KB read (~100,000 a step for the int4 0.6B shape; the TLB covers a few MB). torch's allocator asks
for huge pages only when THP_MEM_ALLOC_ENABLE is set, and then only for allocations of 2 MB or more, which leaves
out the smaller matrices. Measured in one process, the same int4 0.6B-shaped weights (int4 body, int8 head; one row,
the engine's kernels) in torch's 4 KB pages and in one madvise(MADV_HUGEPAGE) arena, alternating:
two threads 23.4 -> 21.0 ms and 24.3 -> 20.5 ms per pass (median), one thread 40.5 -> 38.1 ms.

How: one anonymous mapping per model, madvised for huge pages and started at a 2 MB boundary; each weight is copied
into it in turn and re-pointed there (a Parameter's data, a buffer, or the tuple of a kernel's own layout:
a quantized layer's `kernel_state.stream`), so the old copy is freed as the next one is made
(the peak is the model plus 64 MB, not twice the model). Tied weights stay one tensor. The kernel backs the
mapping with huge pages where it can and with 4 KB pages where it cannot, so this never fails for lack of them.
Where THP is off (`never`) or not Linux, nothing moves. LEVERLAB_NO_HUGE_PAGES=1 turns it off (A/B runs).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import mmap
import sys
from pathlib import Path

import torch

from leverlab import env

log = logging.getLogger("leverlab")

HUGE = 2 << 20  # the x86-64 huge page
ALIGN = 64  # each tensor starts on a cache line
TRIM_EVERY = 64 << 20  # bytes moved between two returns of the freed memory (_release_freed)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _release_freed() -> None:
    """Hands the old copies' memory back to the system. glibc keeps freed blocks under its (adaptive, up to
    32 MB) mmap threshold in its heap, so without this the process kept most of them: +400 MB resident for the
    int8 0.6B shape (VmRSS after loading, with and without the move)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator returns memory its own way
        pass


def thp_mode() -> str:
    """The kernel's THP setting (`always`, `madvise`, `never`), or `none` where there is no THP here."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return "none"
    try:
        text = THP_SETTING.read_text()
    except OSError:
        return "none"
    return text[text.index("[") + 1:text.index("]")] if "[" in text else "none"


# A slot names where a weight lives: (owner, "param" / "buffer" / "attr", name, index in a tuple or None). The
# streaming kernels' copies sit in a quantized layer's runtime state (quant/base.py: KernelState, a dataclass
# attribute of the layer), as tuples (`stream`: weights, scales): "attr" slots whose owner is that state object.
Slot = tuple


def _slots(model: torch.nn.Module) -> list[Slot]:
    """Every contiguous CPU tensor of every module: parameters, buffers and tensor-holding attributes. Names, not
    tensors: holding the tensors would keep every old copy alive until the move ends."""
    def fits(t) -> bool:
        return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous() and t.numel() > 0

    out = []
    for module in model.modules():
        out += [(module, "param", n, None) for n, t in module._parameters.items() if t is not None and fits(t)]
        out += [(module, "buffer", n, None) for n, t in module._buffers.items() if fits(t)]
        owners = [module] + [v for n, v in vars(module).items()
                             if not n.startswith("_") and dataclasses.is_dataclass(v) and not isinstance(v, type)]
        for owner in owners:
            for n, v in vars(owner).items():
                if n.startswith("_") or isinstance(v, torch.nn.Parameter):
                    continue
                if fits(v):
                    out.append((owner, "attr", n, None))
                elif isinstance(v, tuple):
                    out += [(owner, "attr", n, i) for i, t in enumerate(v) if fits(t)]
    return out


def _get(slot: Slot) -> torch.Tensor:
    module, kind, name, index = slot
    v = module._parameters[name] if kind == "param" else module._buffers[name] if kind == "buffer" else vars(module)[name]
    return v if index is None else v[index]


def _set(slot: Slot, new: torch.Tensor) -> None:
    module, kind, name, index = slot
    if kind == "param":
        module._parameters[name].data = new
    elif kind == "buffer":
        module._buffers[name] = new
    elif index is None:
        vars(module)[name] = new
    else:
        v = vars(module)[name]
        vars(module)[name] = (*v[:index], new, *v[index + 1:])


def _key(t: torch.Tensor) -> tuple:  # one per distinct tensor: tied weights (one storage, one shape) share it
    return t.data_ptr(), t.dtype, tuple(t.shape)


def _nbytes(t: torch.Tensor) -> int:
    return (t.numel() * t.element_size() + ALIGN - 1) // ALIGN * ALIGN


def huge_page_buffer(nbytes: int) -> torch.Tensor | None:
    """A uint8 tensor of nbytes in memory madvised for huge pages, starting at a 2 MB boundary, as the weights
    are after move_to_huge_pages (None where THP is off or not here)."""
    if thp_mode() in ("never", "none"):
        return None
    arena = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena.madvise(mmap.MADV_HUGEPAGE)
    base = torch.frombuffer(arena, dtype=torch.uint8)  # the view keeps the mapping alive
    start = -base.data_ptr() % HUGE
    return base[start:start + nbytes]


def move_to_huge_pages(model: torch.nn.Module) -> int:
    """Moves the model's CPU weights into one huge-page arena; returns the bytes moved (0: nothing moved)."""
    mode = thp_mode()
    if mode in ("never", "none") or env.flag("LEVERLAB_NO_HUGE_PAGES"):
        return 0
    slots = _slots(model)
    offsets: dict[tuple, int] = {}  # key -> offset in the arena
    size = 0
    for slot in slots:
        t = _get(slot)
        if _key(t) not in offsets:
            offsets[_key(t)] = size
            size += _nbytes(t)
    if size == 0:
        return 0
    base = huge_page_buffer(size)  # the views below keep the mapping alive
    moved: dict[tuple, torch.Tensor] = {}  # old key -> its new tensor (tied weights met again)
    since_trim = 0
    with torch.no_grad():
        for slot in slots:
            t = _get(slot)
            if base.data_ptr() <= t.data_ptr() < base.data_ptr() + base.numel():
                continue  # a tied Parameter met a second time: moved already
            new = moved.get(_key(t))
            if new is None:
                off = offsets[_key(t)]
                new = base[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                new.copy_(t)
                moved[_key(t)] = new
                since_trim += t.numel() * t.element_size()
            _set(slot, new)
            del t
            if since_trim > TRIM_EVERY:  # the old copies freed so far go back now, so the peak stays low
                _release_freed()
                since_trim = 0
    _release_freed()
    log.debug("weights in huge-page memory (THP %s): %.0f MB", mode, size / 1e6)
    return size
