"""What every ``iop`` command prints: its answer (text or JSON) on stdout, a failure as one line on stderr.

``CliError`` is the one error a command raises for a problem it can name: ``main`` prints it as
``iop COMMAND: message`` on stderr and exits with its code (2 unless the command says otherwise:
1 when a service refused what was asked, 2 when it could not be asked or the input is wrong).
``emit`` prints an answer as indented JSON or as text; ``table`` lays rows out in columns.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

__all__ = ["CliError", "emit", "table", "warn"]


class CliError(Exception):
    """A problem a command can name: one line on stderr, and the exit code."""

    def __init__(self, message: str, code: int = 2, *, error: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.error = error
        """The IOP error code a service answered with, when one did (0: none)."""


def emit(value: object, *, as_json: bool, text: str) -> None:
    """Print ``value`` as JSON when asked, else ``text``."""
    print(json.dumps(value, indent=2) if as_json else text)


def warn(command: str, message: str) -> None:
    """One line on stderr that is not a failure (``iop COMMAND: message``)."""
    print(f"iop {command}: {message}", file=sys.stderr)


def table(rows: Sequence[Sequence[str]], *, last_free: bool = False) -> str:
    """``rows`` (the header first) in columns two spaces apart; ``last_free``: the last column is not padded."""
    columns = list(zip(*rows, strict=True))
    fields = [f"{{:{max(map(len, column))}}}" for column in columns]
    if last_free:
        fields[-1] = "{}"
    line = "  ".join(fields)  # one format for every row: `iop nodes ls` lays out a row per node, 1,000 of them
    return "\n".join([line.format(*row).rstrip() for row in rows])
