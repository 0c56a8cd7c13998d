"""Our C++ CPU kernels and what runs them: the sources (csrc/), their build and loader (cpu_kernels), the
torch custom-op wrapper that compiled graphs see (custom_op), and huge-page weight buffers (huge_pages).

The bottom floor above the plain types: imports torch and leverlab.env only, so every other package (quant,
layers, models, ...) can reach a kernel without reaching up. CPU feature probes are env.cpu_flags() and the
module's own has_*() checks.
"""
