"""Fixtures shared across test packages."""

import contextlib
import os
import tempfile

import pytest

# Tests never touch the user's ledger or caches: one throwaway $EYAS_HOME per test session, set before any
# test (or server subprocess it starts) reads it. Tests that need their own home monkeypatch it further.
_SESSION_HOME = tempfile.mkdtemp(prefix="eyas-test-home-")
os.environ["EYAS_HOME"] = _SESSION_HOME

# Triton kernels (eyas.kernels) run on the CPU through Triton's interpreter in tests. The flag is read when
# a kernel is decorated, i.e. when its module is first imported, so it is set here, before any test module
# imports eyas. With EYAS_TEST_CUDA=1 (on a GPU machine) the kernels compile for the GPU instead.
if os.environ.get("EYAS_TEST_CUDA") != "1":
    os.environ["TRITON_INTERPRET"] = "1"


def on_gpu() -> bool:
    """Whether tests run on the GPU, the kernels compiled: EYAS_TEST_CUDA=1 on a machine with CUDA. Else the
    CPU, the kernels in Triton's interpreter."""
    import torch

    return os.environ.get("EYAS_TEST_CUDA") == "1" and torch.cuda.is_available()


@pytest.fixture(scope="session")  # session-wide, so module fixtures (models built once) can use it too
def device():
    return "cuda" if on_gpu() else "cpu"


@pytest.fixture
def plan():
    """plan(**changes) changes eyas's execution plan for the rest of the test (execution_plan.using), and
    the plan before the test is back once it ends."""
    from eyas import execution_plan

    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(execution_plan.using(**changes))


def _skip_nested_interpreter_patching():
    """Halve the time kernels take in Triton's interpreter, without changing what they compute.

    A kernel launch (GridExecutor.__call__) patches triton.language for the interpreter, runs every program of
    the grid, then restores it. Every call of a @triton.jit helper inside the kernel (InterpretedFunction.
    __call__) patches the language again (Triton 3.x), with inspect.getmembers over tl, tl.core, tl.math and
    tl.tensor, thousands of times per launch. Inside a launch that has already patched the modules the helper
    sees, that second patch replaces each patched attribute with an equivalent one (and never restores it), so
    it is skipped here; every other call patches as before. Skipped silently where Triton's internals differ.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_lang = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    scope = getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or executor is None or scope is None or getattr(patch_lang, "eyas_tests", False):
        return
    import threading

    launch_call, local, langs_of_fn = executor.__call__, threading.local(), {}

    def langs_of(fn):  # the language modules visible from fn, as _patch_lang finds them
        if fn not in langs_of_fn:
            langs_of_fn[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                        if v is interpreter.tl or v is interpreter.tl.core)
        return langs_of_fn[fn]

    def patch_once_per_launch(fn):
        patched = getattr(local, "patched", None)  # None outside a launch
        if patched is not None:
            langs = langs_of(fn)
            if langs and langs <= patched:
                return scope()  # nothing to restore: the launch's own scope restores everything
            patched |= langs
        return patch_lang(fn)

    def launch(self, *args, **kwargs):
        outer, local.patched = getattr(local, "patched", None), set()
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            local.patched = outer

    patch_once_per_launch.eyas_tests = True
    interpreter._patch_lang = patch_once_per_launch
    executor.__call__ = launch


if os.environ.get("TRITON_INTERPRET") == "1":
    _skip_nested_interpreter_patching()


def _one_intra_op_thread():
    """One torch thread in the test process. The tests' models are small: a second thread gains nothing (the
    demo-model tests take as long with one), while beside any other load on a small machine OpenMP's threads
    wait on each other at every op: on 2 cores the warm-up coverage test took 33 s instead of 11 s next to one
    busy process, and tests of tiny models ran up to 20x slower in full-suite runs beside another job. Server and
    worker subprocesses choose their own (eyas.dist.worker); spawned test ranks set theirs."""
    import torch

    torch.set_num_threads(1)


_one_intra_op_thread()


_peer_build = None  # the background build of the peers' venvs (tests/peers/envs.py), when one runs


def pytest_collection_finish(session):
    """Where peer tests are selected, their venvs build in a background process while the tests before them run
    (one torch thread here leaves a core to pip): on a fresh machine that is a minute and a half of installs."""
    global _peer_build
    peers = os.path.join(os.path.dirname(__file__), "peers")
    if any(str(item.path).startswith(peers + os.sep) for item in session.items):
        from tests.peers.envs import build_in_background

        _peer_build = build_in_background()


def pytest_sessionfinish(session):
    if _peer_build is not None and _peer_build.poll() is None:  # a run stopped early: no build left behind
        from tests.helpers import stop_process_group

        with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
            stop_process_group(_peer_build, timeout=10)


@pytest.fixture(scope="session")
def demo_dir():
    """The converted SmolLM2 demo checkpoint (float32), converted once per test session."""
    from eyas.models.demo import demo_model_path

    return demo_model_path()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target, draft) directories of tests.server.tiny.predictable_pair: a tiny target and an EAGLE-3 draft
    whose first guess is always accepted. Built once per test module that asks for it."""
    from tests.server.tiny import predictable_pair

    root = tmp_path_factory.mktemp("pair")
    return predictable_pair(root / "target", root / "draft")
