"""Triton kernels may read module globals only when they are `tl.constexpr`: the GPU compiler refuses anything
else (NameError at compile time), while the CPU interpreter silently accepts it. This catches it on CPU."""
import ast
import importlib
import inspect
import pkgutil
import textwrap
import types

import triton
import triton.language as tl

import kernels


def jit_functions():
    for info in pkgutil.walk_packages(kernels.__path__, "kernels."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            fn = getattr(value, "fn", None)
            if isinstance(fn, types.FunctionType) and fn.__module__ == module.__name__ and \
                    type(value).__name__ in ("JITFunction", "InterpretedFunction"):
                yield module, name, fn


def test_jit_functions_read_only_constexpr_globals():
    found, bad = 0, []
    for module, name, fn in jit_functions():
        found += 1
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        params = {a.arg for a in tree.body[0].args.args}
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in params \
                    and node.id in vars(module):
                value = vars(module)[node.id]
                allowed = (isinstance(value, (types.ModuleType, tl.constexpr)) or callable(value)
                           or value is triton or value is tl)
                if not allowed:
                    bad.append(f"{module.__name__}.{name} reads global {node.id} = {value!r}")
    assert found >= 8, found  # the walk sees the kernels
    assert not bad, "\n".join(bad)
