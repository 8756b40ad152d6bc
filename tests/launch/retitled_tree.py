"""A server process tree shaped like SGLang's: the launcher serves HTTP and spawns (multiprocessing, spawn) a
scheduler per TP rank and a detokenizer, each of which retitles itself with setproctitle
("sglang::scheduler_TP0", "sglang::detokenizer") as SGLang's do.

Usage: python retitled_tree.py PORT [--tp N] [--drop-spt-noenv]

--drop-spt-noenv: the children delete SPT_NOENV before retitling, like a program that ignores it, so their
/proc/PID/environ is overwritten whatever the launcher set. Children exit when the launcher does.
"""

import json
import multiprocessing as mp
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def child(title: str, drop_spt_noenv: bool, ready) -> None:
    if drop_spt_noenv:
        os.environ.pop("SPT_NOENV", None)  # unsetenv: the library's getenv no longer sees it
    import setproctitle

    setproctitle.setproctitle(title)
    ready.set()
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.2)


def main(argv: list[str]) -> int:
    port = int(argv[0])
    tp = int(argv[argv.index("--tp") + 1]) if "--tp" in argv else 2
    drop = "--drop-spt-noenv" in argv
    ctx = mp.get_context("spawn")
    titles = [f"sglang::scheduler_TP{r}" for r in range(tp)] + ["sglang::detokenizer"]
    events = [ctx.Event() for _ in titles]
    procs = [ctx.Process(target=child, args=(t, drop, e), daemon=True) for t, e in zip(titles, events)]
    for p in procs:
        p.start()
    for e in events:
        if not e.wait(60):
            return 1
    info = {"tp_size": tp, "mem_fraction_static": 0.3, "speculative_algorithm": None, "version": "test-tree",
            "launch_command": " ".join(sys.argv)}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = {"/health": b"", "/server_info": json.dumps(info).encode()}.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args):
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
