"""A compiled Triton kernel may read only constexpr globals (and other @triton.jit functions and
modules); the interpreter the CPU tests run under reads any global, so a kernel that reads a plain int
passes every CPU test and fails to compile on a GPU. This check reads every kernel's globals on a CPU."""
import importlib
import inspect
import pkgutil
import types

import pytest
import triton
import triton.language as tl

import minivllm.kernels as kernels

try:  # under TRITON_INTERPRET=1, @triton.jit makes an InterpretedFunction
    from triton.runtime.interpreter import InterpretedFunction
    JIT_TYPES = (triton.runtime.JITFunction, InterpretedFunction)
except ImportError:
    JIT_TYPES = (triton.runtime.JITFunction,)


def jit_functions():
    found = []
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"minivllm.kernels.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, JIT_TYPES) and value.fn.__module__ == module.__name__:
                found.append((f"{info.name}.{name}", value))
    return found


def code_names(code: types.CodeType) -> set[str]:
    """Every name a function's code (and its nested code) loads."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= code_names(const)
    return names


def bad_globals(fn) -> list[str]:
    """The module globals `fn` reads that a compiled kernel may not: anything but a constexpr, a
    @triton.jit function, a module or a class (a dtype, tl.constexpr itself)."""
    allowed = (tl.constexpr, *JIT_TYPES, types.ModuleType, type, tl.dtype)
    return sorted(name for name in code_names(fn.fn.__code__)
                  if name in fn.fn.__globals__ and not isinstance(fn.fn.__globals__[name], allowed))


FUNCTIONS = jit_functions()


def test_kernels_are_found():
    names = {name for name, _ in FUNCTIONS}
    assert len(FUNCTIONS) >= 20 and "gemv.gemv_kernel" in names and "paged_decode.paged_decode_kernel" in names


@pytest.mark.parametrize("fn", [fn for _, fn in FUNCTIONS], ids=[name for name, _ in FUNCTIONS])
def test_kernel_reads_only_constexpr_globals(fn):
    assert not bad_globals(fn), f"{bad_globals(fn)}: make them tl.constexpr(...) globals"


def test_the_check_catches_a_plain_int_global():
    source = "import triton\nLIMIT = 4\n@triton.jit\ndef k(x):\n    return x + LIMIT\n"
    module = types.ModuleType("planted")
    exec(compile(source, inspect.getfile(test_the_check_catches_a_plain_int_global), "exec"), module.__dict__)
    assert bad_globals(module.k) == ["LIMIT"]
    module.LIMIT = tl.constexpr(4)
    assert bad_globals(module.k) == []
