"""Launching compiled Triton kernels at a fraction of the JIT's host cost.

Theory of operation
-------------------
A JIT launch (``kernel[grid](*args)``) binds and specialises every argument and hashes its
options before it finds the compiled kernel: tens of microseconds a launch, as much as the GPU
spends on the staging copy of a piece of a few MiB. ``_launch`` makes the first launch of each
specialisation through the JIT (which compiles, or finds the kernel in Triton's caches), keeps
its compiled kernel (``_compiled``), and calls that kernel's launcher directly afterwards
(``_call``). The key holds everything the JIT specialises these kernels on (every int parameter is
``do_not_specialize``): each pointer argument's dtype and 16-byte alignment, each int's width,
the constexprs and options, the device. The interpreter, launch hooks (a profiler), or a Triton
whose compiled kernels look otherwise take the JIT every time (``_jit_only``).

Both kinds of kernels launch through here: the staging copies (``kvproto.kernels.triton_kernels``)
and the kernel path's pattern and rows copies (``kvproto.kernels.paged``, whose ``PagedLaunch``
binds a launch once and calls ``_call`` with addresses).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from triton.runtime.interpreter import InterpretedFunction

NUM_WARPS = 8
_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


_compiled: dict[tuple[Any, ...], Any] = {}
"""Compiled kernels by ``_launch``'s key: what Triton specialises a launch on."""


def _launch(kernel: Any, grid: tuple[int, int], args: tuple[Any, ...], constants: dict[str, Any],
            stream: Any = None) -> Any:
    """``kernel[grid](*args, **constants)`` on the current stream (or on ``stream``, a CUDA stream
    that need not be current: ``kvproto.kernels.lane``), at a fraction of its host cost;
    returns what later launches of this specialisation call (``_direct``'s answer; False: the JIT).

    A JIT launch binds and specialises every argument and hashes its options before it finds the
    compiled kernel: tens of microseconds, the same again as the whole staging copy of a piece of
    a few MiB takes the GPU. Here the first launch of each specialisation goes through the JIT
    (which compiles, or finds the kernel in Triton's caches) and its compiled kernel is kept;
    later launches call the compiled kernel's launcher directly. The key holds everything the JIT
    specialises on for these kernels (every int parameter is ``do_not_specialize``): each pointer
    argument's dtype and 16-byte alignment, each int's width, the constexprs and options, the
    device. The interpreter, launch hooks, or a Triton whose compiled kernels look otherwise take
    the JIT path every time. A launch made again and again with most arguments the same binds
    them once instead (``PagedLaunch``)."""
    if isinstance(kernel, InterpretedFunction) or _jit_only():
        _jit(kernel, grid, args, constants, stream)
        return False
    spec = [-0x80000000 <= a < 0x80000000 if a.__class__ is int else (a.dtype, not a.data_ptr() & 15) for a in args]
    device = torch.cuda.current_device()
    key = (id(kernel), device, *spec, *constants.items())
    known = _compiled.get(key)
    if known is None:
        compiled = _jit(kernel, grid, args, constants, stream)
        known = _compiled[key] = _direct(kernel, compiled, len(args), constants)
        return known
    if known is False:
        _jit(kernel, grid, args, constants, stream)
        return known
    _call(known, grid, args, device, stream)
    return known


def _jit(kernel: Any, grid: tuple[int, int], args: tuple[Any, ...], constants: dict[str, Any], stream: Any) -> Any:
    """The JIT's launch (on ``stream``, made current for it, where one is named)."""
    if stream is None:
        return kernel[grid](*args, **constants)
    with torch.cuda.stream(stream):
        return kernel[grid](*args, **constants)


def _call(known: Any, grid: tuple[int, int], args: tuple[Any, ...], device: int, stream: Any = None) -> None:
    """A compiled kernel's launcher called directly (``_direct``'s answer) on ``stream`` (a CUDA
    stream), or on the current stream of ``device`` (the current device)."""
    run, function, metadata, tail = known
    run(grid[0], grid[1], 1, torch._C._cuda_getCurrentRawStream(device) if stream is None else stream.cuda_stream,
        function, metadata, None, None, None, *args, *tail)


def _direct(kernel: Any, compiled: Any, positional: int, constants: dict[str, Any]) -> Any:
    """What ``_launch`` calls a compiled kernel with (its launcher, function handle, packed metadata,
    the constexpr values after the positional arguments, in signature order), or False where this
    Triton's compiled kernels do not have that shape."""
    try:
        if hasattr(compiled, "result"):
            compiled = compiled.result()
        run = compiled.run  # loads the module on first use
        tail = tuple(constants[name] for name in kernel.arg_names[positional:])
        return run, compiled.function, compiled.packed_metadata, tail
    except (AttributeError, KeyError, TypeError):
        return False


def _jit_only() -> bool:
    """Whether every launch takes the JIT path: launch hooks are set (a profiler: they see JIT
    launches only), or this Triton predates ``triton.knobs`` (3.4), whose launchers took other
    arguments."""
    knobs = _knobs()
    if knobs is None:
        return True
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    # a chain of hooks (Triton 3.5 on) is always there: it counts once something joined it
    return any(hook is not None and bool(getattr(hook, "calls", True)) for hook in hooks)


@functools.cache
def _knobs() -> Any:
    try:
        from triton import knobs
    except ImportError:
        return None
    return knobs



def _address(arg: Any) -> Any:
    """A launch argument as the compiled kernel's launcher may take it: an array as its address
    (``data_ptr``), anything else as it is."""
    return arg.data_ptr() if hasattr(arg, "data_ptr") else arg


@functools.cache
def _word_tensor(word: int, device: torch.device) -> torch.Tensor:
    """A tensor of ``word``-byte elements on ``device``: a kernel's word type (never read)."""
    return torch.empty(1, dtype=_WORDS[word], device=device)
