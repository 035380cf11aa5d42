"""The IOP control-plane: many nodes as one platform.

    registry (what each node serves, its state and load)  ->  scheduler.choose() -> Decision
                                                           <-  policy (aliases, routes, labels, limits)

``registry``, ``pool``, ``ring``, ``scheduler`` and ``policy`` are sans-IO: no sockets, no asyncio.
Around them, the service: ``nodes`` (node.register / node.status sessions into the registry),
``relay`` (runs placed, relayed and failed over), ``admin`` (nodes.* and policy.* operations),
``store`` (the SQLite node audit), ``settings``, ``bootstrap`` (the composition root) and
``main`` (``iop control-plane --config cp.yaml``).
"""

from __future__ import annotations
