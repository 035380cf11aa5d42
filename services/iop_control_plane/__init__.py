"""The IOP control-plane: many nodes as one platform.

    registry (what each node serves, its state and load)  ->  scheduler.choose() -> Decision
                                                           <-  policy (aliases, routes, labels, limits)

``registry``, ``pool``, ``ring``, ``scheduler`` and ``policy`` are sans-IO: no sockets, no asyncio.
"""

from __future__ import annotations
