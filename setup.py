"""Builds edgespec's batch-invariant CPU kernels at install time (everything else is in pyproject.toml).

`pip install .` (and `pip install -e .`) compiles llama.cpp's `ggml-cpu` from the source that the
pinned llama-cpp-python vendors, with edgespec/patches/ applied and the same `CMAKE_ARGS`, into
edgespec/_kernels/ (about a minute on 2 cores; edgespec/kernel_build.py). edgespec loads it in place
of llama-cpp-python's own at run time (edgespec/kernels.py). A failed build never fails the
install, whatever fails: edgespec then runs llama.cpp's stock kernels, the next `run`, `chat`,
`serve` or `batch` says so in one line, and `edgespec kernels --build` tries again.
`EDGESPEC_KERNELS_BUILD=0` skips it (recorded as skipped, said the same way).
"""

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent


def _kernel_build():
    # by path: importing the edgespec package would need its dependencies, not installed yet
    spec = importlib.util.spec_from_file_location("_edgespec_kernel_build", HERE / "edgespec" / "kernel_build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class BuildKernels(build_ext):
    """The one "extension": the patched libggml-cpu.so.0 and its manifest in edgespec/_kernels/."""

    def run(self):
        dest = (HERE if self.inplace or getattr(self, "editable_mode", False) else Path(self.build_lib))
        dest = dest / "edgespec" / "_kernels"
        try:
            kb = _kernel_build()
        except Exception as e:  # noqa: BLE001 (never fails the install: stock kernels run)
            print(f"edgespec: warning: the kernel build could not start ({e}); stock kernels run", file=sys.stderr)
            return
        say = lambda msg: print(f"edgespec: {msg}", file=sys.stderr, flush=True)  # noqa: E731
        why = kb.unsupported()
        if why:
            return
        if os.environ.get(kb.SKIP_ENV) == "0":
            kb.record_failure(dest, kb.BuildError(f"{kb.SKIP_ENV}=0"), skipped=True)
            return
        try:
            m = kb.build(dest, log=say)
            say(f"batch-invariant CPU kernels built in {m['seconds']} s: {dest / kb.LIB}")
        except Exception as e:  # noqa: BLE001 (a network answer, a full disk, a toolchain: never fails the install)
            try:
                kb.record_failure(dest, e)
            except OSError:
                pass
            say(f"warning: the batch-invariant CPU kernels were not built ({e}); edgespec runs llama.cpp's "
                f"stock kernels and says so on the next run (`edgespec kernels --build` tries again)")
            if getattr(e, "detail", ""):
                print(e.detail, file=sys.stderr)

    def get_outputs(self):
        return []


setup(ext_modules=[Extension("edgespec._kernels.ggml_cpu", sources=[])], cmdclass={"build_ext": BuildKernels})
