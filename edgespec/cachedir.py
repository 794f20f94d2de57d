"""The user cache folder every part of edgespec keeps its files in (models, cost curves, kernels,
history): a leaf module, so that the kernels' loader and the model catalog can both read it
without importing each other."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$EDGESPEC_CACHE`, else the platform's user cache folder: ~/.cache/edgespec on Linux,
    ~/Library/Caches/edgespec on macOS, %LOCALAPPDATA%\\edgespec\\Cache on Windows."""
    env = os.environ.get("EDGESPEC_CACHE")
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_path

    return user_cache_path("edgespec", appauthor=False)
