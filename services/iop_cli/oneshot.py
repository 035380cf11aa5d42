"""What an admin command (``iop nodes ls``: one request, one answer, a new process each time) need not pay for.

Most of such a process's time is its start and its exit, so two costs that suit long-lived processes
are skipped (measured on ``iop nodes ls`` with 1,000 nodes, instructions by valgrind's callgrind):

- protobuf's pure-Python message module. protobuf 7 imports ``google.protobuf.internal.python_message``
  from ``descriptor_pool`` and ``internal.builder`` whichever backend it runs on, and that module
  brings ``text_format``, the Python decoder and encoder and the containers (about 17 ms of the
  command's start by ``python -X importtime``, 7% of its instructions). On the upb backend
  (protobuf's wheels) nothing uses it: upb makes the message classes, parses, prints and
  serializes; its ``_message`` imports only ``message``, ``internal.enum_type_wrapper`` and
  ``internal.well_known_types``; ``builder`` never touches the name and ``descriptor_pool`` only
  for its own pure-Python descriptors, which upb replaces. Registered through the standard
  library's :class:`importlib.util.LazyLoader`, the module is executed at its first attribute
  access: never on upb, on first use anywhere else.
- the cyclic garbage collector: its collections while the modules load and the answer is read,
  and its full collections at exit, which trace every object the process made only for the
  operating system to free them all (8% of its instructions). The garbage is bounded: one answer,
  at most a frame.
"""

from __future__ import annotations

import gc
import importlib.util
import sys
from collections.abc import Callable

__all__ = ["DEFERRED", "defer_pure_python_protobuf", "run_without_collector"]

DEFERRED = "google.protobuf.internal.python_message"
"""The module left unexecuted on upb."""


def defer_pure_python_protobuf() -> None:
    """Make :data:`DEFERRED` load lazily; call before protobuf's first import, in a one-threaded
    command (a lazy module executes in whichever thread touches it first, unguarded on Python 3.11).

    Does nothing when it is imported already (protobuf is loaded) or protobuf runs on its pure-Python
    backend (its message classes are that module: deferring would gain nothing)."""
    if DEFERRED in sys.modules:
        return
    from google.protobuf.internal import api_implementation  # loads upb's _message: needed next anyway

    if api_implementation.Type() == "python":
        return
    spec = importlib.util.find_spec(DEFERRED)
    if spec is None or spec.loader is None:
        return
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[DEFERRED] = module
    package, _, name = DEFERRED.rpartition(".")
    setattr(sys.modules[package], name, module)  # as an import would: `from package import name` finds it here
    spec.loader.exec_module(module)


def run_without_collector(command: Callable[[], int]) -> int:
    """Run ``command`` with the cyclic collector off, and leave what it made to the exit: only for a
    process that exits next (its objects stay allocated until then)."""
    gc.disable()
    code = command()
    gc.freeze()  # the interpreter's collections at exit skip frozen objects
    return code
