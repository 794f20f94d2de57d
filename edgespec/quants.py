"""The weight types `edgespec quantize` writes: llama.cpp's file types (LLAMA_FTYPE_MOSTLY_*), by name.
Apart from llama.py so that the command line lists them without loading llama.cpp."""

QUANT_TYPES = {"q4_0": 2, "q4_1": 3, "q8_0": 7, "f16": 1, "q2_k": 10, "q3_k_m": 12, "q4_k_m": 15, "q5_k_m": 17,
               "q6_k": 18, "iq4_nl": 25, "iq4_xs": 30}
