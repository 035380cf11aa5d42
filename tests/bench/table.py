"""The table every benchmark prints."""

from __future__ import annotations

from collections.abc import Sequence


def print_table(rows: Sequence[tuple[str, str]], unit: str = "result") -> None:
    """Print ``(benchmark, result)`` rows as an aligned two-column table."""
    width = max(len(name) for name, _ in rows)
    value_width = max(len(unit), *(len(value) for _, value in rows))
    print(f"{'benchmark':<{width}}  {unit:>{value_width}}")
    print(f"{'-' * width}  {'-' * value_width}")
    for name, value in rows:
        print(f"{name:<{width}}  {value:>{value_width}}")
