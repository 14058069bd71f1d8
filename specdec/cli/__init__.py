"""The `specdec` command line: the top layer; it may import every layer below it."""

from specdec.cli.main import main

__all__ = ["main"]
