"""CUDA graphs faked on the CPU, faithful to what matters to the engine's use of them.

graphs.capture runs a function twice (warm-up) before recording it, and a replay runs it again: a graph's
body therefore runs three times on first use and must be pure or idempotent. The fake runs a body twice at
capture and twice per replay, each replay writing into the outputs of the capture, so that a body which is
not idempotent shows on every step, not only on a graph's first use. `enable(engine, rerun=False)` runs
each body once instead (a real replay), for a test about which graphs exist rather than what they compute.
"""

import pytest
import torch

import eyas.engine.graphs as graphs_mod
import eyas.layers.attention as attention_mod


def _copy_into(dst, src):
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif hasattr(dst, "hidden"):
        _copy_into(dst.hidden, src.hidden)
        if dst.aux_hidden is not None:
            _copy_into(dst.aux_hidden, src.aux_hidden)
    else:
        for d, s in zip(dst, src):
            _copy_into(d, s)


class _ReplayByRerun:
    def __init__(self, fn, outputs, rerun):
        self.fn, self.outputs, self.rerun = fn, outputs, rerun

    def replay(self):
        if self.rerun:
            self.fn()
        _copy_into(self.outputs, self.fn())


@pytest.fixture
def fake_graphs(monkeypatch):
    """Patch graphs.capture; `enable(engine)` then gives a CPU engine its CUDA-graph paths. Graph keys follow
    the GPU's kernel path (two row widths), not the doubling buckets of the torch attention."""
    twice = [True]  # enable()'s rerun, for the engine it enabled

    def capture(fn, pool):
        if twice[0]:
            fn()  # the warm-up runs, as graphs.capture does
        outputs = fn()
        return _ReplayByRerun(fn, outputs, twice[0]), outputs

    monkeypatch.setattr(graphs_mod, "capture", capture)
    monkeypatch.setattr(graphs_mod.torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(graphs_mod, "kernel_reads_cache", lambda kv: True)
    monkeypatch.setattr(attention_mod, "kernel_reads_cache", lambda kv: True)

    def enable(engine, rerun=True):
        twice[0] = rerun
        engine.runner.graphs = graphs_mod.CudaGraphs(engine.runner)
        return engine

    return enable
