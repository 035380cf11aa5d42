"""The IOP node: where inference runs.

    transport (wire Handler)  ->  core.Node  ->  router.resolve() -> ExecutionSpec
                                             ->  admission (per-model slots + priority queue)
                                             ->  adapter.execute(spec, sink)   (mock, cli, ...)
                                             ->  store (SQLite run history)

``bootstrap.build_node`` is the one composition root; ``main`` is ``iop node``.
"""

from __future__ import annotations
