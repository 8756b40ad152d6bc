"""A benchmark's body in a spawned child process, killed after a timeout, so that a deadlocked GPU kernel ends
the run with a message instead of holding the GPU."""

import multiprocessing as mp
import sys
import time


def run_in_child(target, args, timeout_s: float) -> None:
    """Run target(args) in a spawned child; exit with its exit code, or 3 (saying so) once timeout_s passed."""
    child = mp.get_context("spawn").Process(target=target, args=(args,))
    t0 = time.time()
    child.start()
    child.join(timeout_s)
    if child.is_alive():
        child.kill()
        child.join()
        print(f"HANG: the benchmark did not finish within {timeout_s:.0f} s; killed it", flush=True)
        sys.exit(3)
    print(f"done in {time.time() - t0:.0f} s", flush=True)
    sys.exit(child.exitcode)
