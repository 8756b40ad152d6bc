"""ServeRecorder keeps the engines' execution plan in the serve run's results, while it runs and once it ends."""

from eyas.ledger.ledger import Ledger
from eyas.ledger.serve_record import ServeRecorder


def test_the_execution_plan_is_in_the_run_while_it_runs_and_after(tmp_path):
    db = str(tmp_path / "runs.db")
    warnings = []
    rec = ServeRecorder.open(db, ["eyas", "serve"], {"model": "m"}, None, None, {}, {}, warnings.append)
    summary = {"plan": {"pdl": True}, "kernels": False}
    rec.execution_plan(summary)
    run_id = rec.run_id
    with Ledger(db) as ledger:
        assert ledger.get(run_id).results == {"execution_plan": summary}
    rec.finish("ok", {"requests_ok": 3})
    with Ledger(db) as ledger:
        run = ledger.get(run_id)
    assert run.status == "ok" and run.results["execution_plan"] == summary and run.results["requests_ok"] == 3
    assert not warnings
