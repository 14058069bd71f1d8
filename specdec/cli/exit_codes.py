"""Exit codes of the `specdec` commands."""

OK, FAILED, USAGE = 0, 1, 2
