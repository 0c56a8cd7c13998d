"""Model definitions and loading: the model config (config.py), the decoder (decoder.py) and its
mixture-of-experts block (moe.py: router, experts grouped by expert), the fused C++ decode step (fused.py), the loader, which builds a model, shards it, attaches its quantization methods and reads the
checkpoint (loader.py; a GGUF file's config and tensors through gguf_file.py and gguf_loader.py), the tokenizer
(tokenizer.py), and `leverlab quantize`, which writes a quantized checkpoint folder (quantize.py).

May import layers, quant, distributed, kernels and the plain types; never core, worker or anything above.
"""
