"""Writing a safetensors file, with a failed write as one clear error.

Usage: save_tensors(tensors, path, metadata={"format": "pt"})

safetensors reports a failed write (a full disk, a folder that is gone) as its own SafetensorError, which is not
an OSError, so callers that turn OSErrors into messages would let it through as a traceback.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eyas.errors import EyasError


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None):
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        # e.g. "Error while serializing: I/O error: No space left on device (os error 28)"
        reason = str(e).split(": ", 1)[-1]
        raise EyasError(f"could not write {path}: {reason}") from None
