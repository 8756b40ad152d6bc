"""graph_capture.capture warms up, captures, and captures again once after the driver invalidated a capture."""

import contextlib

import pytest
import torch

import eyas.kernels.graph_capture as graph_capture


class _Stream:
    def wait_stream(self, other):
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's stream and graph calls as no-ops on the CPU; `failures` lists the errors that the next
    captures raise, in turn."""
    failures = []

    @contextlib.contextmanager
    def graph(g, pool=None):
        yield
        if failures:
            raise failures.pop(0)

    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", _Stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", graph)
    return failures


def counting():
    calls = []

    def fn():
        calls.append(1)
        return len(calls)
    return fn, calls


def test_an_invalidated_capture_is_captured_again(fake_cuda, capsys):
    fake_cuda.append(torch.AcceleratorError("CUDA error: operation failed due to a previous error during capture"))
    fn, calls = counting()
    graph, out = graph_capture.capture(fn, None)
    assert out == 6 and len(calls) == 6  # two warm-ups and a capture, twice
    assert "capture failed (CUDA error: operation failed due to a previous error during capture)" \
        in capsys.readouterr().err


def test_the_error_is_raised_when_every_attempt_fails(fake_cuda):
    fake_cuda.extend(RuntimeError("operation failed due to a previous error during capture") for _ in range(2))
    fn, calls = counting()
    with pytest.raises(RuntimeError, match="previous error during capture"):
        graph_capture.capture(fn, None)
    assert len(calls) == 3 * graph_capture.CAPTURE_ATTEMPTS


def test_other_errors_are_not_retried(fake_cuda):
    fake_cuda.append(RuntimeError("CUDA out of memory"))
    fn, calls = counting()
    with pytest.raises(RuntimeError, match="out of memory"):
        graph_capture.capture(fn, None)
    assert len(calls) == 3


@pytest.mark.parametrize("fail", [False, True])
def test_no_garbage_collection_during_a_capture(fake_cuda, fail):
    """The collector is off while the graph is recorded (not during the warm-ups) and on again after it,
    whether the capture returned or raised."""
    import gc

    if fail:
        fake_cuda.extend(RuntimeError("CUDA out of memory") for _ in range(1))
    enabled = []

    def fn():
        enabled.append(gc.isenabled())
        return len(enabled)
    assert gc.isenabled()
    if fail:
        with pytest.raises(RuntimeError):
            graph_capture.capture(fn, None)
    else:
        graph_capture.capture(fn, None)
    assert enabled == [True, True, False] and gc.isenabled()
