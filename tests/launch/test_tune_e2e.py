"""A tiny real sweep on CPU: baseline + a chain + one impossible point, each a recorded launch."""

from pathlib import Path

from eyas.cli import main
from eyas.ledger.ledger import Ledger
from tests.launch.conftest import write_config


def test_tiny_sweep_records_each_point_and_plots(tmp_path, capsys, pair, prompts):
    target, draft = pair
    config = write_config(tmp_path / "t.toml", model=str(target), draft=str(draft), env={"OMP_NUM_THREADS": "1"})
    png = tmp_path / "tune.png"
    code = main(["tune", "--config", config, "--steps", "2", "--topk", "1,2", "--draft-tokens", "9",
                 "--dataset", str(prompts), "--num-prompts", "2", "--max-tokens", "12", "--plot", str(png)])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "skipped steps 2, topk 2, draft tokens 9" in err  # more than 2 steps of top-2 drafting hold
    rows = [ln for ln in out.splitlines() if ln.startswith("config ")]
    assert len(rows) == 2 and rows[0].split()[1:4] == ["-", "-", "-"]  # baseline first
    assert [r.split()[1:4] for r in rows[1:]] == [["2", "1", "3"]]
    best = next(ln for ln in out.splitlines() if ln.startswith("best: "))
    # A timed race on a shared CPU: either the setting wins, or the baseline stays best and says by how much.
    assert "accept length" in best and ("over the baseline" in best or "no setting beat it" in best)
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    with Ledger() as ledger:
        runs = ledger.list({"kind": "tune"}, descending=False)
    assert [r.config["spec_steps"] for r in runs] == [None, 2]
    assert len({r.config["launch"]["tune"]["sweep"] for r in runs}) == 1 and all(r.status == "ok" for r in runs)
    assert runs[1].results["accept_length"] > 1.5  # the predictable draft is accepted
    assert Path(runs[1].results["log"]).is_file()
