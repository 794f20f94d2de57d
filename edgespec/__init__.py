"""edgespec: local LLM inference made faster by lossless speculative decoding on llama.cpp."""

__version__ = "0.1.0"

# Before anything imports llama_cpp: its CPU kernels replaced by edgespec's batch-invariant build
# where one is installed (edgespec/kernels.py; docs/exactness.md).
from . import kernels as _kernels  # noqa: E402

_kernels.preload()
