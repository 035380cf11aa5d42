"""The ``iop`` command: one entry point that dispatches to each service's own commands."""

from __future__ import annotations
