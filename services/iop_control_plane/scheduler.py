"""Scheduling: which node runs a model's next run.

``choose`` resolves the name (an alias to its model; a route to one of its models, by weight:
smooth weighted round-robin, or by session; a pick that is full or has no candidate gives its
run to the route's other models, heaviest first, so weights hold while every target has room),
then picks among the model's candidates (ready nodes with the model available, carrying the
labels the policy and the request ask for, not already tried) by the model's policy:

- ``least-loaded`` (default): lowest (in flight + queued + sent since the last report) / capacity;
- ``round-robin``: the next candidate with a free slot, in turn;
- ``session-affinity``: the session's node on a consistent-hash ring (key: the session, else
  the caller) while it has a free slot, else the least loaded;
- ``prefix``: the candidate holding the longest known prefix of the run's prompt (``prompt``,
  from :func:`~iop_control_plane.prefix.prompt_prefixes`) unless its load / capacity exceeds the
  least loaded's by more than the policy's ``prefix_imbalance`` (then the holder of a shorter
  one, else the least loaded); a placed run's prefixes are recorded for its node. A holder that
  is full yet within the bound is waited for (all_busy, ``waits_for``), while another candidate
  has room: that room is not worth the prefill the holder saves. A holder's load counts the
  runs waiting for it (``waiting``), so a hot prefix still spreads.

A placed decision counts as sent (``Registry.sent``); the service calls ``Registry.finished``
when that run ends on the node, whatever the outcome. Decisions read indexes kept by the
registry: a heap, a rotation and a ring per model, so no decision sorts or scans all nodes.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Mapping, Set
from typing import Literal, NamedTuple

from iop_control_plane.policy import Policy, PolicyName
from iop_control_plane.pool import Accept, ModelPool
from iop_control_plane.prefix import Prefix, PrefixIndex, PrefixReason
from iop_control_plane.registry import CONTINUES, Labels, ModelView, Registry
from iop_control_plane.registry import continuing as with_continuing
from iop_control_plane.registry import running as with_running
from iop_control_plane.ring import point
from iop_gen.pb.iop import runtime_pb2 as pb

__all__ = ["Decision", "Outcome", "Scheduler"]

Outcome = Literal["placed", "all_busy", "no_candidate", "unknown_model", "unsupported_kind"]
"""placed: a node was chosen; all_busy: candidates exist, none has a free slot (the run waits);
no_candidate: nodes serve the model, none may take it now; unknown_model: no node serves it;
unsupported_kind: nodes serve the model, none of them takes the run's kind (a bad request)."""
_PLACED_BY_KIND: dict[int, str] = {pb.RUN_KIND_COUNT_TOKENS: "count tokens"}
"""Run kinds not every backend takes, placed only on nodes whose model lists them (what such a run does)."""


class Decision(NamedTuple):
    """Where a run goes, and why (a named tuple: made at every decision, it costs a third of a frozen dataclass)."""

    node_id: str | None
    """The chosen node; None unless placed."""
    model: str
    """The model as nodes serve it (after alias and route); retries pass this back."""
    policy: PolicyName
    """The policy that decided."""
    outcome: Outcome
    """What came of it."""
    reason: str
    """One line for the debug log."""
    route: str | None = None
    """The alias or route the request named, if any."""
    yielded: bool = False
    """all_busy because a background run yields: the candidates with a free slot each have
    interactive runs awaiting their first output."""
    prefix: PrefixReason | None = None
    """Placed by ``prefix``: the node held part of the prompt (hit), only another candidate did
    (imbalance), or none did (miss)."""
    matched: int = 0
    """Placed by ``prefix``: bytes of the prompt the node held (its longest known prefix)."""
    waits_for: str | None = None
    """all_busy under ``prefix`` while a candidate has room: the full node holding the run's longest known
    prefix, within the imbalance, that the run waits for (the queue lets the runs behind it go meanwhile)."""


class _Pick(NamedTuple):
    """A policy's candidate for a decision (a named tuple: one is made at every decision)."""

    view: ModelView | None
    policy: PolicyName
    """The policy that chose it."""
    how: str
    """How, for the debug log."""
    prefix: PrefixReason | None = None
    """Chosen by ``prefix``: as :attr:`Decision.prefix`."""
    held: int = 0
    """Chosen by ``prefix``: how many of the prompt's prefixes the node holds (the longest known)."""


_BY_PREFIX = "by prompt prefix"


class Scheduler:
    """Picks nodes from a :class:`Registry` under a :class:`Policy`."""

    def __init__(
        self, registry: Registry, policy: Policy | None = None, *, prefixes: PrefixIndex | None = None
    ) -> None:
        self.registry = registry
        self.policy = policy or Policy()
        self.prefixes = prefixes if prefixes is not None else PrefixIndex()  # empty, it is falsy: not ``or``
        """The prompt prefixes recently sent to each node (the ``prefix`` policy); a node that leaves loses its own."""
        registry.on_leave(self.prefixes.forget)
        self.waiting: Counter[str] = Counter()
        """Queued runs waiting for each node (the ``prefix`` policy's full holders): kept by the relay, counted
        in a holder's load by the rule."""
        self._credit: dict[str, dict[str, int]] = {}
        self._labels: dict[str, Labels] = {}

    def apply(self, policy: Policy) -> None:
        """Decide under ``policy`` from now on; weighted routes start their rotation afresh."""
        self.policy, self._credit, self._labels = policy, {}, {}

    def choose(
        self,
        model: str,
        *,
        labels: Mapping[str, str] | None = None,
        session: str | None = None,
        caller: str | None = None,
        exclude: Set[str] = frozenset(),
        background: bool = False,
        prompt: tuple[Prefix, ...] = (),
        continuing: int | None = None,
        kind: int | None = None,
        waiting_for: str | None = None,
    ) -> Decision:
        """A node for a run of ``model`` (a model, an alias or a route).

        ``labels`` are required of the node on top of the policy's; ``session`` (else ``caller``) is
        the key of session affinity, and ``session`` alone keeps a route's pick of model; ``exclude``
        names the nodes a failover already tried (a retry passes ``Decision.model`` back as ``model``).
        A ``background`` run yields: it is not placed on a node with interactive runs awaiting
        their first output (``NodeView.awaiting_first_output``), and is all_busy (``yielded``)
        when every candidate with room has some. ``prompt`` holds the run's prompt prefixes, which
        the ``prefix`` policy places by. A run ``continuing`` delivered output (``continuing``: its
        ``pb.RunKind``) goes only to a node whose capabilities list that kind for the model, and so does
        a run whose ``kind`` not every backend takes (counting tokens: ``unsupported_kind`` when none does).
        ``waiting_for``: the node a queued run waits for (counted in :attr:`waiting`): not counted against it.
        """
        key = session or caller
        targets = self._targets(model, session)
        if kind not in _PLACED_BY_KIND:
            kind = None
        place = functools.partial(
            self._place,
            labels=labels,
            key=key,
            exclude=exclude,
            background=background,
            prompt=prompt,
            continuing=continuing,
            kind=kind,
            waiting_for=waiting_for,
        )
        if targets is None:
            return place(model)
        first = place(targets[0], route=model)
        if first.outcome == "placed":
            return first
        busy = first if first.outcome == "all_busy" else None
        for target in targets[1:]:  # the weighted pick is full or has no candidate: the others, heaviest first
            decision = place(target, route=model)
            if decision.outcome == "placed":
                return decision
            busy = busy or (decision if decision.outcome == "all_busy" else None)
        if busy is not None:  # the run waits for a slot
            return busy
        return first._replace(reason=f"{first.reason}; the route's other models have none either")

    def _targets(self, name: str, session: str | None) -> list[str] | None:
        """The models ``name`` stands for, the one to try first first; None when it is a model."""
        if (alias := self.policy.aliases.get(name)) is not None:
            return [alias]
        route = self.policy.routes.get(name)
        if route is None:
            return None
        first = self._by_weight(route, point(session) % sum(route.values())) if session else self._in_turn(name, route)
        return [first, *sorted((target for target in route if target != first), key=lambda target: -route[target])]

    def _by_weight(self, route: Mapping[str, int], ticket: int) -> str:
        """The target whose share of the weights holds ``ticket`` (a session keeps its model)."""
        for target, weight in route.items():
            if ticket < weight:
                return target
            ticket -= weight
        raise AssertionError("ticket beyond the total weight")

    def _in_turn(self, name: str, route: Mapping[str, int]) -> str:
        """Smooth weighted round-robin: exact shares, evenly interleaved (90/10 gives 9 a, 1 b per 10)."""
        credit = self._credit.setdefault(name, dict.fromkeys(route, 0))
        for target, weight in route.items():
            credit[target] += weight
        chosen = max(credit, key=credit.__getitem__)
        credit[chosen] -= sum(route.values())
        return chosen

    def _place(
        self,
        model: str,
        labels: Mapping[str, str] | None,
        key: str | None,
        exclude: Set[str],
        route: str | None = None,
        *,
        background: bool = False,
        prompt: tuple[Prefix, ...] = (),
        continuing: int | None = None,
        kind: int | None = None,
        waiting_for: str | None = None,
    ) -> Decision:
        policy, wanted = self.policy.policy_for(model), self._wanted(model, labels, continuing, kind)
        pool = self.registry.pool(model, wanted)
        if pool is None or (kind is not None and not pool and not self.registry.taking(model, kind)):
            return self._unplaceable(model, policy, route, None if pool is None else kind)
        accept = (lambda view: view.node.node_id not in exclude) if exclude else None
        if background:  # never waits for a full holder: the room it yields is for interactive runs
            pick = self._pick(pool, policy, _unprompted(accept), key, prompt, wait=False)
            if pick.view is None or not pick.view.free:
                held = self._pick(pool, policy, _free(accept), key, prompt, wait=False).view
                if held is not None:  # room there, but interactive runs come first
                    waiting = held.node.awaiting_first_output
                    why = f"{held.node.node_id} has room, and {waiting} interactive run(s) awaiting a first output"
                    return Decision(None, model, policy, "all_busy", why, route, yielded=True)
                if pick.view is None:  # every candidate has interactive runs waiting, and none has room
                    pick = self._pick(pool, policy, accept, key, prompt, wait=False)
        else:
            pick = self._pick(pool, policy, accept, key, prompt, waiting_for=waiting_for)
        view, policy = pick.view, pick.policy
        if view is None:
            why = self._why_none(model, pool, wanted, continuing, kind)
            return Decision(None, model, policy, "no_candidate", why, route)
        load = view.load
        where = f"{view.node.node_id} at {load}/{view.capacity}"
        if load >= view.capacity:  # not free; a full holder picked is within the imbalance of a node with room
            waits_for = view.node.node_id if pick.prefix == "hit" else None
            if waits_for is None:
                why = f"every candidate is full ({where})"
            else:
                why = f"waiting for {where}, which holds {prompt[pick.held - 1].size} bytes of the prompt"
            return Decision(None, model, policy, "all_busy", why, route, waits_for=waits_for)
        node_id, how = view.node.node_id, pick.how
        self.registry.sent(node_id, model)
        if pick.prefix is None:
            return Decision(node_id, model, policy, "placed", f"{how}: {where}", route)
        self.prefixes.record(node_id, model, prompt, held=pick.held)  # the node holds the prompt from now on
        matched = prompt[pick.held - 1].size if pick.held else 0
        why = f"{how}: {where} ({pick.prefix}, {matched} bytes held)"
        return Decision(node_id, model, policy, "placed", why, route, prefix=pick.prefix, matched=matched)

    def _pick(
        self,
        pool: ModelPool,
        policy: PolicyName,
        accept: Accept,
        key: str | None,
        prompt: tuple[Prefix, ...] = (),
        *,
        wait: bool = True,
        waiting_for: str | None = None,
    ) -> _Pick:
        """The candidate for a decision, the policy that chose it and how (``wait``: ``prefix`` may pick a full
        holder to wait for; ``waiting_for``: the one the run waits for already)."""
        if policy == "round-robin":
            return _Pick(pool.next_in_turn(accept), policy, "next in turn")
        least = pool.least_loaded(accept)
        if policy == "least-loaded" or least is None:
            return _Pick(least, policy, "least loaded")
        if policy == "prefix":
            return self._by_prefix(pool, accept, least, prompt, wait=wait, waiting_for=waiting_for)
        if key is None:
            return _Pick(least, "least-loaded", "no session or caller; least loaded")
        home = pool.home(key, accept)
        if home is not None and home.free:
            return _Pick(home, policy, "session's node")
        return _Pick(least, policy, "session's node full; least loaded")

    def _by_prefix(
        self,
        pool: ModelPool,
        accept: Accept,
        least: ModelView,
        prompt: tuple[Prefix, ...],
        *,
        wait: bool,
        waiting_for: str | None,
    ) -> _Pick:
        """The least loaded holder of the longest prefix of ``prompt`` whose load / capacity is within the
        imbalance over ``least``'s (the least loaded candidate); ``least`` when there is none. A holder's
        load counts the runs waiting for it (but this one, ``waiting_for``). With ``wait``, the holder
        may be full while ``least`` has room: the run then waits for it. Without, only holders with room
        count.

        One pass over the index finds what the chosen node holds too: a holder of a longer prefix
        would have been chosen at that prefix, and ``least`` never fails the bound, so when it is
        chosen it holds none of the prompt.
        """
        if not least.free:
            return _Pick(least, "prefix", _BY_PREFIX)  # every candidate is full: the run waits
        bound = least.load / least.capacity + self.policy.imbalance_for(least.model)
        views, candidate_held, waiting = pool.views, False, self.waiting
        for at, holders in self.prefixes.holders(least.model, prompt):
            best, lowest = None, bound
            for node_id in holders:
                view = views.get(node_id)
                if view is None:
                    continue
                candidate_held = True
                if not (wait or view.free) or (accept is not None and not accept(view)):
                    continue
                load = view.load
                if waiting and (queued := waiting[node_id] - (node_id == waiting_for)) > 0:
                    load += queued
                if (share := load / view.capacity) <= lowest:
                    best, lowest = view, share
            if best is not None:
                return _Pick(best, "prefix", _BY_PREFIX, "hit", at + 1)
        return _Pick(least, "prefix", _BY_PREFIX, "imbalance" if candidate_held else "miss")

    def _wanted(self, model: str, labels: Mapping[str, str] | None, continuing: int | None, kind: int | None) -> Labels:
        """What a candidate must carry: the policy's labels, the run's, and the pseudo-labels of what it must do."""
        wanted = self._constraints(model)
        if labels:
            wanted = tuple(sorted({*wanted, *labels.items()}))  # both must hold: a clash leaves no candidate
        if continuing is not None:
            wanted = with_continuing(continuing, wanted)  # a pool of its own: no scan past nodes that cannot
        if kind is not None:
            wanted = with_running(kind, wanted)  # the same: a pool of the nodes taking the kind
        return wanted

    @staticmethod
    def _unplaceable(model: str, policy: PolicyName, route: str | None, kind: int | None) -> Decision:
        """No node serves ``model`` (``kind`` None), or none serving it takes runs of ``kind``."""
        if kind is None:
            return Decision(None, model, policy, "unknown_model", f"no registered node serves {model!r}", route)
        why = f"no node serving {model!r} can {_PLACED_BY_KIND[kind]}"
        return Decision(None, model, policy, "unsupported_kind", why, route)

    def _constraints(self, model: str) -> Labels:
        """The labels the policy asks of ``model``'s nodes (the registry keeps a pool for them)."""
        found = self._labels.get(model)
        if found is None:
            settings = self.policy.models.get(model)
            if settings is None:
                return ()  # not cached: a requester may name any number of models no policy knows
            found = self._labels[model] = tuple(sorted(settings.labels.items()))
        return found

    def _why_none(self, model: str, pool: ModelPool, wanted: Labels, continuing: int | None, kind: int | None) -> str:
        """Why no candidate fits (runs only when none does)."""
        everyone = self.registry.pool(model)
        if not everyone:
            return f"{self.registry.serving(model)} node(s) serve {model!r}, none ready with it available"
        able = ["can continue a run of its kind"] if continuing is not None else []
        able += [f"can {_PLACED_BY_KIND[kind]}"] if kind is not None else []
        if not pool:
            shown = ", ".join(f"{name}={value}" for name, value in wanted if name != CONTINUES)
            if not able:
                return f"none of {len(everyone)} candidate(s) for {model!r} has labels {shown}"
            labelled = f" and has labels {shown}" if shown else ""
            return f"none of {len(everyone)} candidate(s) for {model!r} {' and '.join(able)}{labelled}"
        fit = f"that {' and '.join(able)}" if able else "that fit"
        return f"all {len(pool)} candidate(s) for {model!r} {fit} already tried"


def _unprompted(accept: Accept) -> Accept:
    """``accept``, and no interactive run awaiting its first output on the node."""
    if accept is None:
        return lambda view: not view.node.awaiting_first_output
    return lambda view: not view.node.awaiting_first_output and accept(view)


def _free(accept: Accept) -> Accept:
    """``accept``, and a free slot."""
    if accept is None:
        return lambda view: view.free
    return lambda view: view.free and accept(view)
