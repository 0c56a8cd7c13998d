"""The model's building blocks: Linear with its default unquantized method and the quantized ones it can take
(linear.py), the tensor-parallel linears and embedding (parallel.py), paged attention (attention.py), norm,
rotary embeddings, our bf16 streaming linear (bf16_linear.py) and the per-model choice of weight prefetch
(prefetch_tune.py).

May import quant, distributed, kernels and the plain types; never models or anything above.
"""
