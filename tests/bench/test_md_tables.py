"""The benchmarks' markdown tables (benchmarks/md_tables.py) and bench_smollm2's report: every number in a
table is one the run measured, under a header that names the hardware, versions, commit and command."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_smollm2 as bench  # noqa: E402
import md_tables  # noqa: E402


def test_a_table_aligns_numbers_right_and_formats_them():
    text = md_tables.table(["row", "tok/s", "acceptance"], [["plain", 1970.18, None], ["chain", 2201.69, 2.2911]])
    assert text.splitlines() == ["| row | tok/s | acceptance |", "| --- | ---: | ---: |",
                                 "| plain | 1,970.2 |  |", "| chain | 2,201.7 | 2.291 |"]
    with pytest.raises(ValueError, match="2 cells under 3 headers"):
        md_tables.table(["a", "b", "c"], [[1, 2]])


def test_a_ratio_is_empty_where_a_side_is_missing():
    assert md_tables.ratio(2201.7, 1970.2) == "1.118×"
    assert md_tables.ratio(None, 1.0) == "" and md_tables.ratio(1.0, 0.0) == ""


def test_the_header_names_the_command_commit_and_versions():
    header = md_tables.run_header("cpu", ["benchmarks/bench_x.py", "--sections", "a b"])
    assert "Command: `python3 benchmarks/bench_x.py --sections 'a b'`" in header
    assert "commit " in header and "torch " in header and "CPU" in header


def test_the_report_holds_the_run_s_numbers_and_their_ratios():
    results = {
        "header": "HEADER",
        "speed": {"eyas_plain": {"tok_s": 2000.0}, "eyas_chain": {"tok_s": 2200.0, "accept_length": 2.29},
                  "eyas_chain_unfused": {"tok_s": 1900.0, "accept_length": 2.29}, "hf_static": {"tok_s": 400.0}},
        "scaling": {"rounds": 3, "chain_slower_at": [], "speculation_stops_paying_from": None, "rows": [
            {"batch": 8, "plain_tok_s": 8000.0, "chain_tok_s": 11000.0, "chain_accept_length": 2.24,
             "adaptive_tok_s": 10450.0}]},
        "sweep": {"plain_tok_s": 2000.0, "plain_tok_s_rounds": [1990.0, 2010.0], "rounds": 2, "rows": [
            {"spec": "3/1/4", "tok_s": 2300.0, "tok_s_rounds": [2290.0, 2310.0], "accept_length": 2.29,
             "over_plain": 1.15, "phase_ms": {"draft": 0.2, "verify": 0.8, "commit": 0.08, "accept": 0.04}}]},
    }
    text = bench.markdown_report(results)
    assert text.startswith("HEADER\n\n")
    assert "| eyas chain 3/1/4 | 2,200.0 | 2.290 | 1.100× |" in text
    assert "| eyas chain 3/1/4 unfused | 1,900.0 | 2.290 | 0.950× |" in text
    assert "| HF generate, static cache | 400.0 |  | 0.200× |" in text
    assert "eyas plain / HF static cache: 5.000×; eyas chain 3/1/4 / eyas plain: 1.100×." in text
    assert ("The chain's cycle: 1.041 ms (acceptance / tok/s), a plain token 0.500 ms; a draft always right "
            "would give 1.92× plain at that cycle, and 2× needs 4.16 tokens per cycle.") in text
    assert "| 8 | 8,000.0 | 11,000.0 (2.24) | 10,450.0 | 0.950× | 1.375× |" in text
    assert "the median of 3 rounds" in text
    assert "at batch: none measured; it paid at the largest batch measured." in text
    assert ("| 3/1/4 | 2,300.0 | 1.150× | 2.29 | 0.200 | 0.800 | 0.080 | 0.040 | 0.996 | 2.01× | 3.98 | "
            "2,290.0 / 2,310.0 |") in text
    assert "| plain | 2,000.0 | 1.000× |  |  |  |  |  | 0.500 |  |  | 1,990.0 / 2,010.0 |" in text


def test_a_cycle_s_cost_bounds_what_any_draft_could_give():
    """A sweep's figures (plain 1,946.0, chain 3/1/4 2,209.8 tok/s at acceptance 2.291): a
    1.037-ms cycle, so a draft that is always right would give 1.98x plain, and 2x needs 4.04 of its 4
    tokens per cycle. A tree's bound is its deepest path, steps + 1 tokens."""
    got = bench.cycle_arithmetic(2209.8, 2.2911, 1946.0, "3/1/4")
    assert got["cycle_ms"] == pytest.approx(1.0368, abs=1e-4)
    assert got["ceiling"] == pytest.approx(1.9825, abs=1e-3) and got["tokens_for_2x"] == pytest.approx(4.035, abs=1e-3)
    tree = bench.cycle_arithmetic(1800.0, 2.8, 1946.0, "5/4/8 EYAS_X=1")
    assert tree["ceiling"] == pytest.approx(6 / (2.8 / 1800.0) / 1946.0)
    assert bench.cycle_arithmetic(4000.0, 2.0, 1000.0, "1/1/2")["ceiling"] == pytest.approx(4.0)


def test_speculation_stops_paying_where_it_loses_at_every_larger_batch():
    """A chain that loses at batch 1 (one prompt's acceptance) and pays from 8 has not stopped paying there."""
    def rows(*pairs):
        return [{"batch": b, "plain_tok_s": p, "chain_tok_s": c} for b, p, c in pairs]

    got = bench.where_speculation_stops_paying(rows((1, 1945, 1922), (8, 8551, 11520), (64, 41393, 47839),
                                                    (128, 72958, 72628)))
    assert got == {"chain_slower_at": [1, 128], "speculation_stops_paying_from": 128}
    got = bench.where_speculation_stops_paying(rows((64, 2, 1), (8, 1, 2), (128, 2, 1), (1, 2, 1)))
    assert got == {"chain_slower_at": [1, 64, 128], "speculation_stops_paying_from": 64}
    got = bench.where_speculation_stops_paying(rows((1, 2, 1), (8, 1, 2)))
    assert got == {"chain_slower_at": [1], "speculation_stops_paying_from": None}
    row = {"batch": 8, "plain_tok_s": 1.0, "chain_tok_s": 2.0, "chain_accept_length": 2.0, "adaptive_tok_s": 2.0}
    report = bench.markdown_report({"header": "H", "scaling": {"rounds": 1, "rows": [row], **got}})
    assert "slower than plain decoding at batch: 1; it paid at the largest batch measured." in report
    assert "Where each mode's median round went" not in report  # a run from before the phases were timed


def test_the_scaling_report_shows_each_mode_s_median_round_in_phases():
    def phases(seconds, first, tail):
        return dict(seconds=seconds, first_step=first, full=round(seconds - first - tail, 4), tail=tail)

    row = {"batch": 128, "plain_tok_s": 1.0, "chain_tok_s": 1.0, "chain_accept_length": 2.0, "adaptive_tok_s": 1.0,
           "plain_phases_rounds": [phases(0.45, 0.09, 0.001), phases(0.40, 0.08, 0.002), phases(0.50, 0.1, 0.003)],
           "chain_phases_rounds": [phases(0.372, 0.09, 0.086)], "adaptive_phases_rounds": []}
    report = bench.markdown_report({"header": "H", "scaling": {"rounds": 3, "rows": [row]}})
    assert "| 128 | 90.0 / 359.0 / 1.0 | 90.0 / 196.0 / 86.0 |  |" in report


def test_a_report_of_a_run_cut_short_shows_what_it_has():
    """The tables are rewritten as rows arrive: a speed section without HF rows, and no other section."""
    text = bench.markdown_report({"header": "H", "speed": {"eyas_plain": {"tok_s": 1900.0}}})
    assert "| eyas plain | 1,900.0 |  | 1.000× |" in text and "HF static cache: not run" in text
    assert "scaling" not in text.lower() and "side by side" not in text


def test_the_8b_report_holds_each_row_against_its_bound():
    """bench_tp's tables from a row as an H200 run of bench_tp reported it."""
    import bench_tp

    row = {"tp": 1, "variant": "default", "decode_ms": 4.5359, "decode_steady_ms": 4.5504,
           "bandwidth_bound_ms": 3.5822, "copy_bw_tb_s": 4.2089, "fraction_of_bound": 0.78973,
           "fraction_of_bound_steady": 0.78722, "verify4_over_decode": 1.0752, "verify8_over_decode": 1.1814,
           "decode_kernels": {"kernels": 334.0, "top": [{"name": "_slot_attention_kernel", "calls": 32.0,
                                                        "us": 262.6}]}}
    text = bench_tp.markdown_report("H", "llama-8b", 512, [row])
    assert "| 1 | default | 4.536 | 4.550 | 3.582 (4.21 TB/s) | 79.0% | 78.7% | 1.075× | 1.181× | 334 |" in text
    assert "| _slot_attention_kernel | 32 | 262.6 |" in text


def test_the_cycle_profile_table_holds_each_setting():
    results = {"header": "H", "cycle": {"chain": {
        "cycle_ms": 1.0233, "accept_length": 2.3, "kernels_per_cycle": 323.0, "graph_launches_per_cycle": 1.0,
        "eager_kernel_launches_per_cycle": 0.0, "host_wall_ms": 1.1, "gpu_busy_ms": 0.95,
        "phase_ms_per_cycle": {"draft": 0.2, "verify": 0.8}}}}
    text = bench.markdown_report(results)
    assert "| chain | 1.0233 | 2.30 | 323 | 1.0 | 0.0 | 1.1000 | 0.9500 | draft 0.200, verify 0.800 |" in text


def test_a_table_file_without_a_folder_is_refused_before_the_run(tmp_path):
    assert md_tables.writable(str(tmp_path / "t.md"), "bench_x") == str(tmp_path / "t.md")
    assert md_tables.writable("", "bench_x") == ""
    with pytest.raises(SystemExit) as e:
        md_tables.writable(str(tmp_path / "no" / "t.md"), "bench_x")
    assert str(e.value).startswith("bench_x: no folder") and "\n" not in str(e.value)


def test_the_source_digest_follows_the_code_not_git(tmp_path):
    for name in ("src/eyas/a.py", "benchmarks/b.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    (tmp_path / "README.md").write_text("not code")
    first = md_tables.source_digest(tmp_path)
    assert len(first) == 12 and md_tables.source_digest(tmp_path) == first
    (tmp_path / "README.md").write_text("changed, but not code")
    assert md_tables.source_digest(tmp_path) == first
    (tmp_path / "src/eyas/a.py").write_text("x = 2\n")
    assert md_tables.source_digest(tmp_path) != first
    assert "source digest " in md_tables.run_header("cpu", ["x.py"])
