"""edgespec: local LLM inference made faster by lossless speculative decoding on llama.cpp."""

__version__ = "0.1.0"
