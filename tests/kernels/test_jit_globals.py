"""Triton's compiler reads only constexpr globals inside a jit function (a plain float global is a
CompilationError on the GPU), but the interpreter accepts any: this check finds such globals on the
CPU, before a GPU run does."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap
import types

import pytest
import triton.language as tl

import kernels.jit

MODULES = [importlib.import_module(f"kernels.jit.{m.name}") for m in pkgutil.iter_modules(kernels.jit.__path__)]


def _jit_functions(module):
    """(name, python function) of each Triton kernel defined in ``module``: jit, interpreted
    (TRITON_INTERPRET=1) or wrapped by an autotuner, found by unwrapping ``.fn``."""
    for name, obj in vars(module).items():
        fn, wrapped = obj, False
        while not inspect.isfunction(fn) and getattr(fn, "fn", None) is not None:
            wrapped = wrapped or type(fn).__module__.startswith("triton")
            fn = fn.fn
        if wrapped and inspect.isfunction(fn) and fn.__module__ == module.__name__:
            yield name, fn


def _allowed(value) -> bool:
    return isinstance(value, (types.ModuleType, tl.constexpr, type)) or callable(value)


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_jit_functions_read_only_constexpr_globals(module):
    bad = []
    for name, jit in _jit_functions(module):
        tree = ast.parse(textwrap.dedent(inspect.getsource(jit)))
        local = {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)}
        local |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        for n in ast.walk(tree):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in local \
                    and n.id in vars(module) and not _allowed(vars(module)[n.id]):
                bad.append(f"{name} reads {n.id} = {vars(module)[n.id]!r}")
    assert not bad, "; ".join(bad) + " (make it tl.constexpr(...))"
