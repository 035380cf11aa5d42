"""Reading the ready file a service writes once it serves (``iop_wire.settings.write_ready_file``).

Apart from :mod:`iop_cli.platform` (which starts and stops processes and imports the config
editor, YAML and certificate code with it) so that ``iop nodes ls`` and the other commands that
only look up a port start without those imports.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["read_ready"]


def read_ready(ready: Path) -> dict[str, Any] | None:
    """What a service wrote to its ready file; None while there is none (or half of one)."""
    try:
        started = json.loads(ready.read_text())
    except (OSError, ValueError):
        return None
    return started if isinstance(started, dict) else None
