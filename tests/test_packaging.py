"""Packaging promises: the torch-free core imports without torch, and the public names still import."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.parametrize("module", ["pagellm", "pagellm.core", "pagellm.core.scheduler", "pagellm.config",
                                    "pagellm.sampling_params", "pagellm.outputs"])
def test_torch_free_modules_load_no_torch(module):
    assert _run(f"import sys, {module}; print('torch' in sys.modules)") == "False"


def test_public_names_import_lazily():
    code = ("import sys; from pagellm import LLM, SamplingParams, AsyncLLMEngine, EngineArgs; import pagellm; "
            "print(LLM.__name__, SamplingParams.__name__, 'torch' in sys.modules, "
            "set(pagellm.__all__) <= set(dir(pagellm)))")
    assert _run(code) == "LLM SamplingParams True True"


def test_unknown_name_is_an_attribute_error():
    import pagellm

    with pytest.raises(AttributeError, match="no attribute 'NoSuchThing'"):
        pagellm.NoSuchThing  # noqa: B018
