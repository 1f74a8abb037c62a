"""Triton kernels may read module globals only when they are `tl.constexpr`: the GPU compiler refuses anything
else (NameError at compile time), while the CPU interpreter silently accepts it. This catches it on CPU. And a
kernel's per-step counts are not specialised: Triton compiles a variant per value class of an int argument (1,
a multiple of 16, other), so a count that changes from step to step would compile while serving, in a step shape
the warm-up did not run (e.g. an eager prefill of 10 prompts), stalling every request for the compile."""
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


PER_STEP_COUNTS = {"num_seqs", "num_tokens", "num_rows", "num_pairs", "size"}   # change from one step to the next


def test_per_step_counts_of_launched_kernels_are_not_specialised():
    """Read from the source (the interpreter drops the decorator's arguments): every kernel launched as
    `name[grid](...)` lists its per-step count arguments in `do_not_specialize`."""
    found, bad = 0, []
    for info in pkgutil.walk_packages(kernels.__path__, "kernels."):
        source = inspect.getsource(importlib.import_module(info.name))
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, ast.FunctionDef) or f"{node.name}[" not in source:
                continue                                  # (helpers are inlined into the kernels that call them)
            for deco in node.decorator_list:
                if "triton.jit" not in ast.unparse(deco):
                    continue
                found += 1
                unspecialised = {ast.literal_eval(e) for k in getattr(deco, "keywords", [])
                                 if k.arg == "do_not_specialize" for e in k.value.elts}
                counts = PER_STEP_COUNTS & {a.arg for a in node.args.args}
                if counts - unspecialised:
                    bad.append(f"{info.name}.{node.name}: {sorted(counts - unspecialised)} specialised")
    assert found >= 15, found
    assert not bad, bad
