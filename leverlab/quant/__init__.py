"""Quantization levers (issue 6): weight precision per linear layer, and the KV-cache dtype.

Each method is one `QuantMethod` (base.py) in its own file, named in the registry (registry.py; the flag
values are plain data in leverlab/quant_config.py). A method declares the runtime state it keeps on a layer
(base.KernelState); every packer and quantizer lives in layouts.py. The only places outside this package that
know about quantization: `Linear` (runs through its method: layers/linear.py), the loader (attaches the method,
calls `process_weights_after_loading`) and the model runner / attention op (the KV-cache dtype hook).

May import kernels and the plain types; never layers, models or anything above.
"""

from leverlab.quant.base import QuantMethod
from leverlab.quant.registry import get_quant_method, quant_method_for_checkpoint
from leverlab.quant_config import KV_CACHE_DTYPES, QUANT_METHODS

__all__ = ["KV_CACHE_DTYPES", "QUANT_METHODS", "QuantMethod", "get_quant_method", "quant_method_for_checkpoint"]
