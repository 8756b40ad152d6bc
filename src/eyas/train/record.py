"""What a training run leaves behind about itself: `run.json` in the output directory, and a ledger row.

Usage: rec = RunRecorder(out_dir, recipe, argv); rec.stage("fit", results, data_hash); rec.finish("ok", results)

run.json is rewritten (atomically) after every stage, so a crash still leaves the stages that finished;
stages run alone on later invocations are merged in. The ledger (eyas.ledger.ledger) is best effort: a
ledger problem is reported on stderr and never stops training.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from eyas.train.atomic import write_atomic

SUMMARY_KEYS = ("final_loss", "final_acc_k", "accept_length", "accept_length_history", "coverage", "steps")


class RunRecorder:
    def __init__(self, out_dir: Path, recipe, argv: list[str], enabled: bool = True):
        self.path = Path(out_dir) / "run.json"
        self.enabled = enabled
        self.run_id = None
        if not enabled:
            return
        old = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.data = {
            "name": recipe.name, "target": recipe.target, "out_dir": str(Path(out_dir).resolve()),
            "argv": list(argv), "config": recipe.to_dict(), "data_hash": old.get("data_hash"),
            "stages": old.get("stages", {}), "metrics": old.get("metrics", {}), "output": old.get("output"),
            "started_at": time.time(), "status": "running",
        }
        self._ledger_start(recipe, argv)
        self.data["ledger_run_id"] = self.run_id
        self._write()

    def _ledger_start(self, recipe, argv):
        try:
            from eyas.launch.environment import filtered_env
            from eyas.ledger.ledger import Ledger

            with Ledger() as ledger:
                self.run_id = ledger.start_run(kind="train", argv=list(argv), cwd=os.getcwd(), env=filtered_env(),
                                               config=recipe.to_dict(), model=recipe.target)
        except Exception as e:  # the ledger records training; it must never be able to stop it
            print(f"eyas train: not recorded in the run ledger ({type(e).__name__}: {e})", file=sys.stderr)

    def _write(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.path, json.dumps(self.data, indent=2, default=str).encode())

    def stage(self, name: str, results: dict, data_hash: str | None):
        if not self.enabled:
            return
        self.data["stages"][name] = results
        if data_hash:
            self.data["data_hash"] = data_hash
        for k in SUMMARY_KEYS:
            if k in results:
                self.data["metrics"][k] = results[k]
        if name == "export":
            self.data["output"] = results.get("sglang") or next((v for k, v in results.items() if k != "step"
                                                                 and isinstance(v, str)), None)
        self._write()

    def finish(self, status: str, results: dict):
        if not self.enabled:
            return
        self.data.update(status=status, finished_at=time.time())
        self._write()
        if self.run_id is None:
            return
        try:
            from eyas.ledger.ledger import Ledger

            with Ledger() as ledger:
                ledger.finish_run(self.run_id, status, {**self.data["metrics"], "output": self.data["output"],
                                                        "run_json": str(self.path.resolve()),
                                                        "stage_seconds": {k: v.get("seconds") for k, v in
                                                                          self.data["stages"].items()}})
        except Exception as e:
            print(f"eyas train: could not close the ledger run ({type(e).__name__}: {e})", file=sys.stderr)
