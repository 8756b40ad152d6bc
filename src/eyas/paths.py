"""Where eyas keeps its own files."""

import os
from pathlib import Path


def eyas_home() -> Path:
    """$EYAS_HOME, default ~/.cache/eyas; created on first use."""
    home = Path(os.environ.get("EYAS_HOME") or Path.home() / ".cache" / "eyas")
    home.mkdir(parents=True, exist_ok=True)
    return home
