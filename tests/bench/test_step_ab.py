"""bench_step_ab's variants: NAME:[EYAS_K=V,...] separated by ';', bad ones refused in one line; and
bench_slot_attention's graph bound, the kv_len the engine's graphs capture rows with."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_slot_attention  # noqa: E402
import bench_step_ab  # noqa: E402


def test_variants_parse_in_order():
    got = bench_step_ab.parse_variants("old:EYAS_SHORT_ROW_SPLITS=0,EYAS_FUSED_O_PROJ=0; new:")
    assert got == [("old", {"EYAS_SHORT_ROW_SPLITS": "0", "EYAS_FUSED_O_PROJ": "0"}), ("new", {})]


def test_blas_variant_names_a_library():
    assert bench_step_ab.parse_variants("lt:EYAS_BLAS=cublaslt") == [("lt", {"EYAS_BLAS": "cublaslt"})]


@pytest.mark.parametrize("text", ["", "old", ":EYAS_PDL=0", "a:PDL=0", "a:EYAS_PDL", "a:;a:EYAS_PDL=0",
                                  "a:EYAS_BLAS=hipblas"])
def test_bad_variants_are_one_line(text):
    with pytest.raises(SystemExit) as e:
        bench_step_ab.parse_variants(text)
    message = str(e.value)
    assert message and "\n" not in message


def test_graph_bound_follows_the_engine():
    from eyas.engine.graphs import SHORT_ROWS

    assert bench_slot_attention.graph_bound(SHORT_ROWS) == SHORT_ROWS
    assert bench_slot_attention.graph_bound(SHORT_ROWS + 1) == bench_slot_attention.MAX_LEN
