"""What the tests of decoding ahead of the host (test_decode_ahead.py, test_spec_ahead.py) share: prompts over a
32-token vocabulary, plain greedy decoding as the reference, and a batch that changes while work is in flight."""

import torch

from eyas.engine.engine import Engine
from eyas.layers.sampling import SamplingParams

VOCAB = 32


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (k,), generator=g).tolist() for k in (5, 17, 9, 30, 12)[:n]]


def reference(model, ps, params, max_len=256):
    """(tokens, finish reason) per prompt from plain greedy decoding, in step with the host."""
    eng = Engine(model, dtype="fp32", max_batch=len(ps), max_len=max_len)
    return [(s.output_ids, s.finish_reason) for s in eng.generate(ps, params)]


def admission_and_abort_in_flight(model, eng, mode, steps: int, max_tokens: int):
    """Two requests run `steps` steps, a third joins while a step or cycle is in flight (`mode`, the engine's
    DecodeAhead or SpecAhead), then one is aborted: the other two get what they get alone, the aborted one a
    prefix of it."""
    ps = prompts(3, seed=2)
    alone = reference(model, ps, [SamplingParams(max_tokens=max_tokens, ignore_eos=True)] * 3)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    a, b = eng.add(ps[0], params), eng.add(ps[1], params)
    for _ in range(steps):
        eng.step()
    assert mode.active and mode.flights  # in flight when the batch changes
    c = eng.add(ps[2], params)
    eng.step()
    eng.abort(b)
    while eng.has_work():
        eng.step()
    assert a.output_ids == alone[0][0] and c.output_ids == alone[2][0]
    assert b.finish_reason == "abort" and b.output_ids == alone[1][0][:len(b.output_ids)]


def a_stop_learned_late(model, eng, at: int):
    """Three requests, the first with a stop token it emits at output index `at`: the host learns the stop a
    step or cycle late, and every request still gets plain greedy decoding's tokens and finish reason."""
    ps = prompts(3, seed=1)
    free = reference(model, ps, [SamplingParams(max_tokens=40, ignore_eos=True)] * 3)
    params = [SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=[free[0][0][at]])] + \
        [SamplingParams(max_tokens=40, ignore_eos=True)] * 2
    got = [(s.output_ids, s.finish_reason) for s in eng.generate(ps, params)]
    want = reference(model, ps, params)
    assert got == want and want[0][1] == "stop" and len(want[0][0]) < 40
