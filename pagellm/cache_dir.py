"""Where pagellm keeps files it derives once and reuses: converted tokenizers, compiled kernels."""

from __future__ import annotations

import os
import pathlib


def cache_root() -> pathlib.Path:
    """$PAGELLM_CACHE_DIR, else $XDG_CACHE_HOME/pagellm or ~/.cache/pagellm."""
    if os.environ.get("PAGELLM_CACHE_DIR"):
        return pathlib.Path(os.environ["PAGELLM_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "pagellm"
