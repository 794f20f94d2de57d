"""llama.cpp's backend, initialised once, with its log lines kept (shown with EDGESPEC_VERBOSE).

Apart from llama.py so that gguf_check, which llama.py imports, can initialise the backend too.
"""

from __future__ import annotations

import collections
import ctypes
import os
import sys
import threading

import llama_cpp as lc

_LOG: collections.deque[str] = collections.deque(maxlen=64)

_init_lock = threading.Lock()
_initialized = False


@lc.llama_log_callback
def _log_callback(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    # llama.cpp is chatty on stderr; keep its lines for error messages and show them on request.
    line = text.decode("utf-8", "replace")
    _LOG.append(line)
    if os.environ.get("EDGESPEC_VERBOSE"):
        sys.stderr.write(line)


def backend_init() -> None:
    global _initialized
    with _init_lock:
        if _initialized:
            return
        lc.llama_log_set(_log_callback, ctypes.c_void_p(0))
        lc.llama_backend_init()
        _initialized = True
