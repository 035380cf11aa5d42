"""What a reload finds changed in the route table, and how it says so."""

from __future__ import annotations

from iop_node.reload import ReloadSummary, diff_routes, renumbered
from iop_node.settings import ConfigError, Problem, RouteSettings


def _route(model: str, **fields: object) -> RouteSettings:
    return RouteSettings.model_validate({"model": model, "adapter": "mock", **fields})


def test_routes_are_matched_by_model_and_any_field_changed_replaces_them() -> None:
    current = [_route("a"), _route("b"), _route("c", options={"tokens": 3}), _route("d")]
    new = [_route("a"), _route("c", options={"tokens": 4}), _route("e"), _route("d", max_concurrency=9)]
    changes = diff_routes(current, new)
    assert [route.model for route in changes.added] == ["e"]
    assert changes.removed == ("b",)
    assert [route.model for route in changes.replaced] == ["c", "d"]
    assert changes.unchanged == ("a",)
    assert [route.model for route in changes.built] == ["e", "c", "d"]
    assert changes.changed and not diff_routes(current, current).changed
    again = diff_routes(current, current, again={"a"})  # its server failed: started again
    assert [route.model for route in again.replaced] == ["a"] and again.unchanged == ("b", "c", "d")


def test_summary_says_what_changed() -> None:
    changes = diff_routes([_route("a"), _route("b")], [_route("a"), _route("c")])
    said = str(ReloadSummary("node-2", changes, finishing=2, restart=("listen",)))
    assert said == (
        "node-2 reloaded: added c; removed b; 2 runs finishing on the old routes; 1 unchanged; needs a restart: listen"
    )


def test_problems_of_the_routes_built_name_their_place_in_the_file() -> None:
    error = ConfigError([Problem("routes.0.options.x", "bad"), Problem("routes.1.adapter", "unknown")])
    assert str(renumbered(error, [3, 5])) == "routes.3.options.x: bad; routes.5.adapter: unknown"
