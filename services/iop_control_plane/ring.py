"""A consistent-hash ring: a key maps to the same member while that member stays on the ring.

Each member owns ``vnodes`` points; a key belongs to the first point clockwise from its hash.
Adding or removing a member moves only the keys of its own points.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from hashlib import blake2b

__all__ = ["HashRing", "point"]


def point(key: str) -> int:
    """A stable 64-bit position for ``key`` (the same in every process, unlike ``hash``)."""
    return int.from_bytes(blake2b(key.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Members on a ring of 64-bit points, kept sorted as they come and go (no rebuilds)."""

    def __init__(self, vnodes: int = 100) -> None:
        self.vnodes = vnodes
        self._points = array("Q")
        """Sorted positions as machine words: a merge copies memory, not a reference to an int object per point."""
        self._owners: list[str] = []
        self._members: set[str] = set()

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, member: object) -> bool:
        return member in self._members

    def add(self, *members: str) -> None:
        """Put the ``members``' points on the ring (those on it already are skipped).

        One merge of the new points, sorted, into the ring's: a pass that copies the ring in
        slices between them, instead of an insertion (a move of the ring's tail) per point.
        """
        joining = [member for member in dict.fromkeys(members) if member not in self._members]
        arriving = sorted((at, member) for member in joining for at in self._points_of(member))
        self._members.update(joining)
        points, owners, taken = self._points, self._owners, 0
        merged_points = array("Q")
        merged_owners: list[str] = []
        for at, member in arriving:
            index = bisect_right(points, at, taken)  # after the points already there at ``at``
            merged_points += points[taken:index]
            merged_owners += owners[taken:index]
            merged_points.append(at)
            merged_owners.append(member)
            taken = index
        self._points, self._owners = merged_points + points[taken:], merged_owners + owners[taken:]

    def remove(self, member: str) -> None:
        """Take ``member``'s points off the ring (nothing if it is not there): one pass of slices, as ``add``."""
        if member not in self._members:
            return
        self._members.discard(member)
        points, owners, kept = self._points, self._owners, 0
        left_points = array("Q")
        left_owners: list[str] = []
        for at in sorted(self._points_of(member)):
            index = bisect_left(points, at, kept)
            while owners[index] != member:  # another member's point at the same position
                index += 1
            left_points += points[kept:index]
            left_owners += owners[kept:index]
            kept = index + 1
        self._points, self._owners = left_points + points[kept:], left_owners + owners[kept:]

    def walk(self, key: str) -> Iterator[str]:
        """Members clockwise from ``key``'s position, each once: the key's owner first."""
        points, owners, count = self._points, self._owners, len(self._points)
        seen: set[str]
        start, seen = bisect_right(points, point(key)), set()
        for index in range(start, start + count):
            owner = owners[index - count if index >= count else index]
            if owner not in seen:
                yield owner
                seen.add(owner)
                if len(seen) == len(self._members):
                    return

    def _points_of(self, member: str) -> list[int]:
        return [point(f"{member}#{index}") for index in range(self.vnodes)]
