"""Where eyas keeps its own files, and the checks of the paths a command will write, made before its work."""

from pathlib import Path

from eyas.errors import EyasError
from eyas.options import get as option


def eyas_home() -> Path:
    """$EYAS_HOME, default ~/.cache/eyas; created on first use."""
    home = Path(option("EYAS_HOME") or Path.home() / ".cache" / "eyas")
    home.mkdir(parents=True, exist_ok=True)
    return home


def output_file(path: str | Path, flag: str) -> Path:
    """`path` as a file a command may (over)write, given as `flag`: not a directory, in a folder that exists."""
    path = Path(path)
    if path.is_dir():
        raise EyasError(f"{flag} {path} is a directory; give a file path")
    if not path.parent.is_dir():
        raise EyasError(f"{flag} {path}: the folder {path.parent} does not exist or is not a directory")
    return path


def write_output(path: str | Path, text: str, flag: str) -> None:
    """Write a command's text output to the file given as `flag`; a failure is one line, not a traceback."""
    try:
        Path(path).write_text(text)
    except OSError as e:
        raise EyasError(f"cannot write {flag} {path}: {e.strerror or e}") from None


def image_file(path: str | Path, flag: str) -> Path:
    """The file a plot given as `flag` is written to, checked as output_file: matplotlib writes OUT.png for an
    OUT without an extension, so that is the file named and checked."""
    path = output_file(path, flag)
    return path if path.suffix else output_file(path.with_name(path.name + ".png"), flag)


def creatable_dir(path: Path) -> None:
    """Refuse `path` as an output directory when its nearest existing ancestor is not a directory (mkdir would
    fail there only after the command's work)."""
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise EyasError(f"cannot create output directory {path}: {ancestor} is not a directory")
