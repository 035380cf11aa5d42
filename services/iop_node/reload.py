"""Reading the routes again without a restart (SIGHUP, ``iop nodes reload``): what changed, and saying so.

Routes are matched by model name. A route whose every field is the same is *unchanged*: its
adapter instance, admission and runs are not touched. A route with the same model and any field
different is *replaced*: a new adapter instance serves it from the switch on, and the runs that
started before finish on the old one; so is an unchanged route whose server the node gave up
on (FAILED: "not started again until a reload"). The others are *added* or *removed*. Every other setting
is read only at start-up: a reload that finds one changed names it ("needs a restart") and
leaves it as it was.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from iop_node.settings import ConfigError, RouteSettings, Settings

__all__ = ["ReloadSummary", "RouteChanges", "diff_routes", "renumbered", "restart_keys"]

_RELOADED = frozenset({"routes", "reload_grace"})
"""The settings a reload applies; every other one waits for a restart."""
_ROUTE_KEY = re.compile(r"^routes\.(\d+)")


@dataclass(frozen=True, slots=True)
class RouteChanges:
    """The new route table against the one in force."""

    routes: tuple[RouteSettings, ...]
    """The new table, in the file's order."""
    added: tuple[RouteSettings, ...]
    removed: tuple[str, ...]
    """Models no longer routed."""
    replaced: tuple[RouteSettings, ...]
    unchanged: tuple[str, ...]

    @property
    def built(self) -> tuple[RouteSettings, ...]:
        """The routes that need a new adapter instance: added and replaced."""
        return self.added + self.replaced

    @property
    def changed(self) -> bool:
        """Whether the table differs from the one in force."""
        return bool(self.added or self.removed or self.replaced)


def diff_routes(
    current: Sequence[RouteSettings], new: Sequence[RouteSettings], *, again: Collection[str] = ()
) -> RouteChanges:
    """``new`` against ``current``, by model name; the models in ``again`` are replaced even when unchanged."""
    before = {route.model: route for route in current}
    names = {route.model for route in new}

    def same(route: RouteSettings) -> bool:
        return before.get(route.model) == route and route.model not in again

    return RouteChanges(
        routes=tuple(new),
        added=tuple(route for route in new if route.model not in before),
        removed=tuple(route.model for route in current if route.model not in names),
        replaced=tuple(route for route in new if route.model in before and not same(route)),
        unchanged=tuple(route.model for route in new if same(route)),
    )


def restart_keys(running: Settings, read: Settings) -> list[str]:
    """The top-level settings that differ between the ones running and the ones read, other than those a
    reload applies."""
    keys = type(running).model_fields.keys() - _RELOADED
    return sorted(key for key in keys if getattr(running, key) != getattr(read, key))


def renumbered(error: ConfigError, indices: Sequence[int]) -> ConfigError:
    """``error`` about a list of some routes, with each ``routes.N`` key naming the route's place in the
    whole file (``indices[N]``)."""

    def in_file(match: re.Match[str]) -> str:
        return f"routes.{indices[int(match.group(1))]}"

    return ConfigError([replace(problem, key=_ROUTE_KEY.sub(in_file, problem.key)) for problem in error.problems])


@dataclass(frozen=True, slots=True)
class ReloadSummary:
    """What a reload did."""

    node_id: str
    changes: RouteChanges
    finishing: int
    """Runs of removed and replaced routes still going on their old adapters (within ``reload_grace``)."""
    restart: tuple[str, ...] = ()
    """Settings that changed in the file but wait for a restart."""

    def __str__(self) -> str:
        """``node-2 reloaded: added a, b; removed c; replaced d; 2 runs finishing on the old routes; 3 unchanged``."""
        changes, parts = self.changes, []
        if changes.added:
            parts.append("added " + ", ".join(route.model for route in changes.added))
        if changes.removed:
            parts.append("removed " + ", ".join(changes.removed))
        if changes.replaced:
            parts.append("replaced " + ", ".join(route.model for route in changes.replaced))
        if self.finishing:
            parts.append(f"{self.finishing} run{'s' if self.finishing != 1 else ''} finishing on the old routes")
        parts.append(f"{len(changes.unchanged)} unchanged")
        if self.restart:
            parts.append("needs a restart: " + ", ".join(self.restart))
        return f"{self.node_id} reloaded: " + "; ".join(parts)
