"""A consistent-hash ring: a key maps to the same member while that member stays on the ring.

Each member owns ``vnodes`` points; a key belongs to the first point clockwise from its hash.
Adding or removing a member moves only the keys of its own points.
"""

from __future__ import annotations

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
        self._points: list[int] = []
        self._owners: list[str] = []
        self._members: set[str] = set()

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, member: object) -> bool:
        return member in self._members

    def add(self, member: str) -> None:
        """Put ``member``'s points on the ring (nothing if it is there already)."""
        if member in self._members:
            return
        self._members.add(member)
        for at in self._points_of(member):
            index = bisect_right(self._points, at)
            self._points.insert(index, at)
            self._owners.insert(index, member)

    def remove(self, member: str) -> None:
        """Take ``member``'s points off the ring (nothing if it is not there)."""
        if member not in self._members:
            return
        self._members.discard(member)
        for at in self._points_of(member):
            index = bisect_left(self._points, at)
            while self._owners[index] != member:  # another member's point at the same position
                index += 1
            del self._points[index], self._owners[index]

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
