"""The worker's command loop in-process: adds, steps and aborts applied to a real Engine, rank 0's reports."""

from eyas.dist.messages import Abort, AddRequest, Step
from eyas.dist.worker import Lockstep
from eyas.engine.engine import Engine
from eyas.layers.sampling import SamplingParams


class Results(list):
    put = list.append


def test_abort_frees_slots_and_leaves_the_others_untouched(tiny_model):
    alone = Engine(str(tiny_model), dtype="fp32", max_batch=1, max_len=128)
    [want] = alone.generate([[9, 8, 7]], SamplingParams(max_tokens=12, ignore_eos=True))
    engine = Engine(str(tiny_model), dtype="fp32", max_batch=2, max_len=128)
    free = engine.runner.kv.free_slots
    results = Results()
    worker = Lockstep(engine, rank=0, results=results)
    for rid, prompt in (("a", [1, 2, 3]), ("b", [9, 8, 7]), ("c", [4, 5])):  # c waits: two slots
        worker.apply(AddRequest(rid, prompt, SamplingParams(max_tokens=12, ignore_eos=True)))
    worker.apply(Step())
    assert {u.id for u in results[-1].updates} == {"a", "b"} and results[-1].waiting == 1
    worker.apply(Abort("a"))   # running
    worker.apply(Abort("c"))   # still waiting
    worker.apply(Abort("zz"))  # unknown (already finished, say): ignored
    assert engine.runner.kv.free_slots == free - 1 and not engine.waiting
    got = [i for r in results for u in r.updates if u.id == "b" for i in u.new_ids]
    while not results[-1].updates or results[-1].updates[-1].finish_reason is None:
        worker.apply(Step())
        got += [i for u in results[-1].updates if u.id == "b" for i in u.new_ids]
        assert all(u.id == "b" for u in results[-1].updates)
    assert got == want.output_ids
    assert engine.runner.kv.free_slots == free and not engine.running
    assert results[-1].kv_usage == 0.0 and results[-1].running == 0


def test_refused_add_is_reported_not_raised(tiny_model):
    engine = Engine(str(tiny_model), dtype="fp32", max_batch=1, max_len=16)
    results = Results()
    worker = Lockstep(engine, rank=0, results=results)
    worker.apply(AddRequest("big", list(range(10)), SamplingParams(max_tokens=10)))
    worker.apply(Step())
    [update] = results[-1].updates
    assert update.error and "exceeds the context" in update.error and not engine.has_work()
