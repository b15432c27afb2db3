"""The environment of a fresh interpreter pagellm starts (workers, one-off conversions)."""

from __future__ import annotations

import os
import pathlib


def child_environment() -> dict[str, str]:
    """This process's environment with the directory holding this pagellm first on PYTHONPATH, so that a child
    started with sys.executable imports the same package (a source checkout too, where it is not installed)."""
    package_root = str(pathlib.Path(__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env
