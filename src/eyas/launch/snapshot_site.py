"""The interpreter-start hook of a launched server: installed as sitecustomize.py in a folder on its PYTHONPATH.

Every Python process of the server (the launcher, and every process it spawns, which inherits PYTHONPATH) writes
its pid, process start time, argv and os.environ to $EYAS_ENV_SNAPSHOT_DIR/PID.json before any of its own code
runs. That is the environment /proc/PID/environ would show, kept where a later setproctitle cannot overwrite it.
Stdlib only, never raises, and runs the sitecustomize it shadows (a virtualenv's or a distribution's) after it.
"""

import os as _os
import sys as _sys


def _write_snapshot():
    folder = _os.environ.get("EYAS_ENV_SNAPSHOT_DIR")
    if not folder:
        return
    import json

    pid = _os.getpid()
    try:
        with open(f"/proc/{pid}/stat") as f:
            starttime = int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        starttime = None
    record = {"pid": pid, "ppid": _os.getppid(), "starttime": starttime, "argv": list(getattr(_sys, "argv", [])),
              "executable": _sys.executable, "env": dict(_os.environ)}
    path = _os.path.join(folder, f"{pid}.json")
    try:
        # 0600: the environment may hold tokens, readable by its owner only, as /proc/PID/environ is
        with open(_os.open(path + ".tmp", _os.O_WRONLY | _os.O_CREAT | _os.O_TRUNC, 0o600), "w") as f:
            json.dump(record, f)
        _os.replace(path + ".tmp", path)  # a reader never sees half a file
    except OSError:
        pass


def _run_shadowed():
    import importlib.machinery
    import importlib.util

    here = _os.path.dirname(_os.path.abspath(__file__))
    rest = [p for p in _sys.path if _os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        _sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)


try:
    _write_snapshot()
except Exception:  # the server must start whatever happens here
    pass
_run_shadowed()
