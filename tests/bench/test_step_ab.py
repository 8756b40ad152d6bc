"""bench_step_ab's variants: NAME:[FIELD=V,...] (execution plan fields, or blas) separated by ';', bad ones refused in one line; and
bench_slot_attention's graph bound, the kv_len the engine's graphs capture rows with."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_slot_attention  # noqa: E402
import bench_step_ab  # noqa: E402


def test_variants_parse_in_order():
    got = bench_step_ab.parse_variants("old:short_row_splits=0,fused_o_proj=0; new:")
    assert got == [("old", {"short_row_splits": "0", "fused_o_proj": "0"}), ("new", {})]
    assert bench_step_ab.plan_of(got[0][1]) == {"short_row_splits": False, "fused_o_proj": False}
    assert bench_step_ab.plan_of(bench_step_ab.parse_variants("rows:qkv_rotary_rows=8")[0][1]) == {"qkv_rotary_rows": 8}


def test_blas_variant_names_a_library():
    assert bench_step_ab.parse_variants("lt:blas=cublaslt") == [("lt", {"blas": "cublaslt"})]


@pytest.mark.parametrize("text", ["", "old", ":pdl=0", "a:PDL=0", "a:pdl", "a:;a:pdl=0", "a:EYAS_PDL=0",
                                  "a:blas=hipblas", "a:pdl=2", "a:qkv_rotary_rows=x"])
def test_bad_variants_are_one_line(text):
    with pytest.raises(SystemExit) as e:
        bench_step_ab.parse_variants(text)
    message = str(e.value)
    assert message and "\n" not in message


def test_graph_bound_follows_the_engine():
    from eyas.engine.graphs import SHORT_ROWS

    assert bench_slot_attention.graph_bound(SHORT_ROWS) == SHORT_ROWS
    assert bench_slot_attention.graph_bound(SHORT_ROWS + 1) == bench_slot_attention.MAX_LEN
