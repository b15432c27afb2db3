"""Triton kernels on a GPU read only module globals that are `tl.constexpr(...)` (or functions, modules and other
kernels); the interpreter (TRITON_INTERPRET=1, which runs the kernel tests on CPU) reads any global, so a plain
constant compiled there and failed only on the device. This test reads every kernel's source for such globals."""

from __future__ import annotations

import ast
import pathlib

import pytest

import pagellm

SOURCE = pathlib.Path(pagellm.__file__).parent
KERNEL_FILES = sorted(p for p in SOURCE.rglob("*.py") if "triton.jit" in p.read_text())


def _is_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Attribute) and target.attr == "jit"


def _is_constexpr_call(value: ast.expr) -> bool:
    return (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
            and value.func.attr == "constexpr")


def _plain_globals(tree: ast.Module) -> set[str]:
    """Module-level names bound by an assignment of anything but tl.constexpr(...)."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if not _is_constexpr_call(node.value):
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _kernel_reads(function: ast.FunctionDef) -> set[str]:
    local = {a.arg for a in function.args.args + function.args.kwonlyargs}
    local |= {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - local


def test_the_check_finds_kernel_files():
    assert {p.name for p in KERNEL_FILES} >= {"triton_kernels.py", "triton_moe.py", "w8a8_triton.py"}


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: str(p.relative_to(SOURCE)))
def test_kernels_read_only_constexpr_globals(path):
    tree = ast.parse(path.read_text())
    plain = _plain_globals(tree)
    kernels = [node for node in tree.body
               if isinstance(node, ast.FunctionDef) and any(_is_jit(d) for d in node.decorator_list)]
    assert kernels, f"{path.name} names triton.jit but defines no kernel"
    offending = {f"{k.name} reads {name}" for k in kernels for name in _kernel_reads(k) & plain}
    assert not offending, (f"{sorted(offending)}: a plain global compiles only under TRITON_INTERPRET; "
                           "bind it with tl.constexpr(...) or pass it as a tl.constexpr argument")
