"""The adapter of a route with an engine: the node's own server, spoken to by the vllm or ollama adapter.

:class:`ServedAdapter` conforms to ``ports.Adapter`` for one route. Its :class:`Supervisor` runs
the server; the speaking adapter (``inner``) is built for the server's port at each start (the
old one closed). While the server is not READY the model is unavailable and a run is refused
with a retryable UNAVAILABLE naming the state, so the control-plane sends it elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable

from iop_gen.pb.iop import runtime_pb2 as pb
from iop_node.domain import ExecutionSpec
from iop_node.engines.process import EngineFiles
from iop_node.engines.settings import EngineSettings
from iop_node.engines.supervisor import Supervisor
from iop_node.metrics import NodeMetrics
from iop_node.ports import Adapter, EventSink
from iop_node.settings import Problem, StartError
from iop_wire.errors import IopError

__all__ = ["ServedAdapter"]


class ServedAdapter:
    """One served model: its server kept running, and the adapter speaking to it."""

    def __init__(
        self,
        *,
        engine: str,
        model: str,
        target: str,
        settings: EngineSettings,
        files: EngineFiles,
        metrics: NodeMetrics,
        speaker: Callable[[str], Adapter],
        info: pb.ModelInfo,
    ) -> None:
        """``speaker(base_url)`` builds the speaking adapter; ``info`` is the model as told before it is ready."""
        self.name = engine
        self.model = model
        self.supervisor = Supervisor(
            model=model, engine=engine, target=target, settings=settings, files=files, metrics=metrics,
            on_port=self._use_port,
        )  # fmt: skip
        self._speaker = speaker
        self._inner: Adapter | None = None
        self._info = info

    async def _use_port(self, port: int) -> None:
        old, self._inner = self._inner, self._speaker(f"http://127.0.0.1:{port}")
        if old is not None:
            await old.aclose()

    def available(self, model: str) -> bool:
        inner = self._inner
        return self.supervisor.ready and inner is not None and inner.available(model)

    def served(self, model: str) -> pb.ServedModel | None:
        return self.supervisor.served

    async def capabilities(self) -> list[pb.ModelInfo]:
        """The speaking adapter's answer while the server is ready (kept), else the last one, unavailable."""
        if self.supervisor.ready and self._inner is not None:
            infos = await self._inner.capabilities()
            self._info = next((info for info in infos if info.name == self.model), self._info)
        info = pb.ModelInfo()
        info.CopyFrom(self._info)
        info.available = self.available(self.model)
        info.served.CopyFrom(self.supervisor.served)
        return [info]

    async def execute(self, spec: ExecutionSpec, sink: EventSink) -> None:
        inner = self._inner
        if not self.supervisor.ready or inner is None:
            message = f"the {self.name} server of {self.model} is {self.supervisor.describe()}"
            raise IopError(pb.ERROR_CODE_UNAVAILABLE, message, retryable=True)
        await inner.execute(spec, sink)

    async def start(self) -> None:
        """Start the server (in the background: the model is unavailable until it is ready);
        StartError naming ``engines_dir`` when its log cannot be written there."""
        try:
            self.supervisor.start()
        except OSError as exc:
            where = exc.filename or self.supervisor.files.log
            raise StartError([Problem("engines_dir", f"cannot write {where}: {exc.strerror or exc}")]) from None

    async def aclose(self) -> None:
        """Stop the server (SIGTERM, SIGKILL after its grace) and close the speaking adapter."""
        await self.supervisor.stop()
        if self._inner is not None:
            await self._inner.aclose()
