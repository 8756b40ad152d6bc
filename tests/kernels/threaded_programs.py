"""Triton's interpreter with a grid's programs running at once, one thread each, instead of one after another.

The interpreter runs a grid's programs in turn, so a program that polls another's output would spin forever:
the persistent step's CPU tests launch it with one program. Here every program runs in its own thread and
the interpreter's program id is per thread, so programs poll each other's words while the GIL interleaves
them: the kernel's cross-program waits, dealing and epoch words run on the CPU as on a GPU (its memory model
aside). A launch whose programs have not all returned within the deadline raises ProgramsHung, after stopping
them at their next load. This leans on the interpreter's internals (Triton 3.x's GridExecutor and
InterpreterBuilder), as the tests that use it do on purpose.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import sys
import threading
import time
import traceback

import numpy as np
import triton.language as tl
from triton.runtime import interpreter

_program = threading.local()  # this thread's program id and its launch's stop flag


class ProgramsHung(RuntimeError):
    pass


def _get_program_id(builder, axis):
    return interpreter.TensorHandle(np.array([_program.idx[axis]], dtype=np.int32), tl.int32)


def _stoppable(load):
    def masked_load(builder, *args, **kwargs):
        stop = getattr(_program, "stop", None)
        if stop is not None and stop.is_set():
            raise ProgramsHung("stopped: the launch passed its deadline")
        return load(builder, *args, **kwargs)
    return masked_load


def _concurrent_call(deadline_s: float):
    """GridExecutor.__call__ with one thread per program along the grid's first axis."""
    def call(self, *args_dev, **kwargs):
        spec = inspect.getfullargspec(self.fn)
        kwargs = {k: v for k, v in kwargs.items() if k in spec.args or k in spec.kwonlyargs}
        args_hst, kwargs_hst = self._init_args_hst(args_dev, kwargs)
        scope = interpreter._patch_lang(self.fn)
        try:
            args = inspect.getcallargs(self.fn, *args_hst, **kwargs_hst)
            args = {n: a if n in self.constexprs else interpreter._implicit_cvt(a) for n, a in args.items()}
            grid = self.grid(args) if callable(self.grid) else self.grid
            grid = tuple(grid) + (1,) * (3 - len(grid))
            if grid[1:] != (1, 1):
                raise ValueError(f"threaded programs take a one-dimensional grid, not {grid}")
            interpreter.interpreter_builder.set_grid_dim(*grid)
            stop, errors = threading.Event(), []

            def program(x):
                _program.idx, _program.stop = (x, 0, 0), stop
                try:
                    self.fn(**args)
                except BaseException as e:  # noqa: BLE001  re-raised in the launching thread
                    errors.append(e)
                    stop.set()

            threads = [threading.Thread(target=program, args=(x,), daemon=True) for x in range(grid[0])]
            for t in threads:
                t.start()
            end = time.monotonic() + deadline_s  # one deadline for the launch, not one per program
            for t in threads:
                t.join(max(0.0, end - time.monotonic()))
            alive = [(x, t) for x, t in enumerate(threads) if t.is_alive()]
            if alive:
                where = "; ".join(f"program {x} at {_kernel_line(t)}" for x, t in alive)
                stop.set()
                for t in threads:
                    t.join(30)
                raise ProgramsHung(f"{len(alive)} of {grid[0]} programs still ran after {deadline_s:.0f} s: {where}")
            if errors:
                raise errors[0]
        finally:
            scope.restore()
        self._restore_args_dev(args_dev, args_hst, kwargs, kwargs_hst)
    return call


def _kernel_line(thread: threading.Thread) -> str:
    """Where a program's thread is in the kernel's source: its frames outside this harness, Triton and the
    standard library, innermost first, with the item it runs (the kernel's loop variable `it`)."""
    frame = sys._current_frames().get(thread.ident)
    if frame is None:
        return "(finished)"
    stdlib = os.path.dirname(os.__file__)
    ours = [(f, n) for f, n in traceback.walk_stack(frame) if not f.f_code.co_filename.startswith((stdlib, "<"))
            and "triton" not in f.f_code.co_filename and f.f_code.co_filename != __file__]
    item = next((f.f_locals["it"] for f, _ in ours if "it" in f.f_locals), None)
    lines = " <- ".join(f"{os.path.basename(f.f_code.co_filename)}:{n} {f.f_code.co_name}" for f, n in ours)
    return lines + (f" (item {item})" if item is not None else "")


def _patched_once(patch_lang):
    """interpreter._patch_lang that does nothing in a program's thread. The launch patches the language
    modules (shared by every module's jit functions) before its programs start and restores them once all
    have returned; the interpreter patches them again at every device-function call, which in a program's
    thread would redo that work thousands of times per launch while other programs read the modules."""
    def patch(fn):
        if getattr(_program, "idx", None) is not None:
            return interpreter._LangPatchScope()
        return patch_lang(fn)
    return patch


@contextlib.contextmanager
def concurrent_programs(deadline_s: float = 120.0):
    """Within the block, interpreted launches run their programs at once (one thread each)."""
    builder, executor = interpreter.InterpreterBuilder, interpreter.GridExecutor
    saved = (builder.create_get_program_id, builder.create_masked_load, executor.__call__, interpreter._patch_lang)
    builder.create_get_program_id = _get_program_id
    builder.create_masked_load = _stoppable(saved[1])
    executor.__call__ = _concurrent_call(deadline_s)
    interpreter._patch_lang = _patched_once(saved[3])
    try:
        yield
    finally:
        (builder.create_get_program_id, builder.create_masked_load, executor.__call__,
         interpreter._patch_lang) = saved
