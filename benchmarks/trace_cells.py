"""The op columns of a traced persistent step's two tables (eyas.kernels.persistent_trace's trace_summary and
critical_path): the persistent benches print them after columns of their own (context, rows, variant)."""

OP_HEADER = "op | items | median wait us | median work us | median notice us | last done us"
OP_RULE = "--- | --- | --- | --- | --- | ---"
PATH_HEADER = ("op on the critical path | items | waited for data | waited for its program | notice us | poll us | "
               "gap us | work us")
PATH_RULE = "--- | ---: | ---: | ---: | ---: | ---: | ---: | ---:"


def op_cells(op: dict) -> str:
    """One op of trace_summary."""
    return (f"{op['op']} | {op['items']} | {op['wait_us']:.2f} | {op['work_us']:.2f} | {op['notice_us']:.2f} | "
            f"{op['last_done_us']:.1f}")


def path_cells(op: dict) -> str:
    """One op of critical_path (its first names the path's length)."""
    length = f" (path {op['length_us']:.1f} us)" if "length_us" in op else ""
    return (f"{op['op']}{length} | {op['items']} | {op['data']} | {op['program']} | {op['notice_us']:.1f} | "
            f"{op['poll_us']:.1f} | {op['gap_us']:.1f} | {op['work_us']:.1f}")
