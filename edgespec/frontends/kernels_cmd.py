"""`edgespec kernels`: which llama.cpp CPU kernels run, and building edgespec's batch-invariant ones."""

from __future__ import annotations

import json
import sys

from .. import kernel_build, kernels
from ..errors import EdgespecError
from .options import KernelsOptions


def describe(info: dict) -> str:
    """One line: what runs and what it means for exact speculation (doctor prints it too)."""
    if info["kernels"] == "batch-invariant":
        floor = kernels.tiled_min_rows()
        return (f"batch-invariant (edgespec's patched ggml-cpu, {info['path']}): batches of up to "
                f"{floor - 1} rows give the bits of one-row decodes on K-quant weights too"
                + ("" if floor == kernels.TILED_MIN_ROWS else f" ({kernels.TILED_MIN_ROWS_ENV}={floor} in the environment)"))
    return (f"llama.cpp's stock kernels ({info['why']}): on K-quant weights (Q4_K_M ...) batches of 4 rows and more "
            "differ from one-row decodes, so exact verification is capped by the exactness probe")


def run_kernels(a: KernelsOptions) -> int:
    if a.build:
        why = kernel_build.unsupported()
        if why:
            raise EdgespecError(why)
        dest = kernels.cache_dir()
        try:
            m = kernel_build.build(dest, log=lambda msg: print(f"edgespec: {msg}", file=sys.stderr, flush=True))
        except kernel_build.BuildError as e:
            if e.detail:
                print(e.detail, file=sys.stderr)
            raise EdgespecError(f"the kernel build failed: {e}") from e
        print(f"edgespec: built in {m['seconds']} s: {dest / kernel_build.LIB}; it is loaded from the next "
              "command on (the newest usable build is loaded: this one, in place of the one `pip install` made)",
              file=sys.stderr)
    import llama_cpp  # noqa: F401  (llama.cpp loaded, so that info() checks what the process maps)

    info = kernels.info()
    if a.json:
        print(json.dumps({**info, "patches": [p.name for p in kernel_build.patches()]}))
        return 0
    print(f"CPU kernels: {describe(info)}")
    print("patches: " + ", ".join(p.name for p in kernel_build.patches()))
    return 0
