"""llama.cpp's staging API for drafting from hidden states, bound with ctypes.

libllama in llama-cpp-python 0.3.36 exports these functions of `src/llama-ext.h` (target-layer
taps for EAGLE-3, the nextn/MTP hidden states, a context's partner context) without `extern "C"`,
so under their Itanium-mangled C++ names, and llama_cpp.py does not bind them. They are bound here
by those names; a libllama without them (another version) gets one clear line when a method needs
them, not a crash at import.
"""

from __future__ import annotations

import ctypes

from .errors import EdgespecError

_P, _F = ctypes.c_void_p, ctypes.POINTER(ctypes.c_float)
_SYMBOLS = {
    "set_embeddings_nextn": ("_Z26llama_set_embeddings_nextnP13llama_contextbb", [_P, ctypes.c_bool, ctypes.c_bool], None),
    "set_nextn_layer_offset": ("_Z28llama_set_nextn_layer_offsetP13llama_contexti", [_P, ctypes.c_int32], None),
    "get_embeddings_nextn": ("_Z26llama_get_embeddings_nextnP13llama_context", [_P], _F),
    "get_embeddings_nextn_ith": ("_Z30llama_get_embeddings_nextn_ithP13llama_contexti", [_P, ctypes.c_int32], _F),
    "set_embeddings_layer_inp": ("_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
                                 [_P, ctypes.c_uint32, ctypes.c_bool], None),
    "get_embeddings_layer_inp": ("_Z30llama_get_embeddings_layer_inpP13llama_contextj", [_P, ctypes.c_uint32], _F),
    "get_ctx_other": ("_Z19llama_get_ctx_otherP13llama_context", [_P], _P),
    "model_target_layer_ids": ("_Z28llama_model_target_layer_idsPK11llama_model", [_P], ctypes.POINTER(ctypes.c_int32)),
    "model_target_layer_ids_n": ("_Z30llama_model_target_layer_ids_nPK11llama_model", [_P], ctypes.c_uint32),
}
_bound: dict[str, object] = {}


def fn(name: str):
    """The bound function `name` (a key of _SYMBOLS); EdgespecError when libllama lacks it."""
    f = _bound.get(name)
    if f is None:
        import llama_cpp

        sym, args, res = _SYMBOLS[name]
        try:
            f = getattr(llama_cpp.llama_cpp._lib, sym)
        except AttributeError:
            raise EdgespecError(f"this libllama has no llama_{name} (llama-cpp-python 0.3.36 exports it; "
                                f"EAGLE-3 and MTP need it)") from None
        f.argtypes, f.restype = args, res
        _bound[name] = f
    return f


def available() -> bool:
    try:
        for name in _SYMBOLS:
            fn(name)
    except EdgespecError:
        return False
    return True
