"""Files that are either whole or absent: write to a temporary sibling, fsync, rename.

Usage: write_atomic(path, data)            # one file
       with atomic_dir(final) as tmp: ...  # a directory of files, renamed into place when the block ends

A full disk (ENOSPC) becomes one clear EyasError and leaves nothing half-written behind: training
state, feature shards and exported drafts are all read back later by code that trusts them.
"""

from __future__ import annotations

import errno
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from eyas.errors import EyasError


def write_bytes(path: Path, data: bytes):
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _error(path: Path, e: OSError, size: int | None = None) -> EyasError:
    if e.errno == errno.ENOSPC:
        need = f" ({size / 2**20:.0f} MiB)" if size else ""
        return EyasError(f"disk full while writing {path}{need}; nothing partial was kept: free space and run again")
    return EyasError(f"cannot write {path}: {e.strerror or e}")


def write_atomic(path: Path, data: bytes):
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write_bytes(tmp, data)
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise _error(path, e, len(data)) from None


@contextmanager
def atomic_dir(final: Path):
    """Yields an empty temporary directory beside `final`; on success it replaces `final` whole."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _error(final, e) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
