"""User-facing errors: the CLI prints them as one line and exits 2."""


class EyasError(Exception):
    """A problem with the user's input or environment, stated in one line."""
