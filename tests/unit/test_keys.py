"""API keys: the hashed key file, the edge's in-memory store, and the per-key limiter."""

from __future__ import annotations

import asyncio
import contextlib
import re
import sqlite3
from pathlib import Path

import pytest
from conftest import assert_eventually

from iop_edge.keys import (
    SECRET_PREFIX,
    ApiKey,
    KeyStore,
    Limiter,
    LimitExceeded,
    create_key,
    list_keys,
    revoke_key,
)
from iop_edge.sqlite_keys import SqliteKeyStorage
from iop_wire.settings import StartError


def _key(name: str = "alice", *, rpm: int | None = None, tpm: int | None = None, conc: int | None = None) -> ApiKey:
    return ApiKey(name=name, key_id="key_test", rpm=rpm, tpm=tpm, max_concurrent=conc)


# The key file


def test_create_returns_a_long_random_secret_and_creates_folders(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "keys.db"
    first, second = create_key(path, "alice"), create_key(path, "bob")
    assert first.startswith(SECRET_PREFIX) and len(first) >= len(SECRET_PREFIX) + 32
    assert first != second
    assert path.is_file() and path.stat().st_mode & 0o077 == 0
    with contextlib.closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_the_file_never_holds_the_secret(tmp_path: Path) -> None:
    path = tmp_path / "keys.db"
    secret = create_key(path, "alice", rpm=10)
    stored = b"".join(file.read_bytes() for file in tmp_path.iterdir())  # the WAL too, if any
    assert secret.encode() not in stored
    assert secret[len(SECRET_PREFIX) :].encode() not in stored


def test_list_shows_limits_and_revocation(tmp_path: Path) -> None:
    path = tmp_path / "keys.db"
    create_key(path, "alice", rpm=10, tpm=1000, max_concurrent=2)
    create_key(path, "bob")
    assert revoke_key(path, "bob")
    alice, bob = list_keys(path)
    assert (alice.name, alice.rpm, alice.tpm, alice.max_concurrent, alice.revoked_at) == ("alice", 10, 1000, 2, None)
    assert alice.key_id.startswith("key_") and alice.key_id != bob.key_id
    assert bob.name == "bob" and bob.revoked_at is not None and bob.rpm is None


@pytest.mark.parametrize(
    ("name", "limits", "message"),
    [
        ("", {}, "key name ''"),
        ("a b", {}, "key name 'a b'"),
        ("tab\t", {}, "key name"),
        ("alice", {"rpm": 0}, "--rpm must be at least 1, not 0"),
        ("alice", {"tpm": -5}, "--tpm must be at least 1"),
        ("alice", {"max_concurrent": 0}, "--max-concurrent must be at least 1"),
    ],
)
def test_create_refuses_bad_names_and_limits(tmp_path: Path, name: str, limits: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)) as caught:
        create_key(tmp_path / "keys.db", name, **limits)
    assert "\n" not in str(caught.value)


def test_create_refuses_a_name_used_before_even_revoked_and_the_reserved_one(tmp_path: Path) -> None:
    path = tmp_path / "keys.db"
    create_key(path, "alice")
    with pytest.raises(ValueError, match="key 'alice' exists"):
        create_key(path, "alice")
    assert revoke_key(path, "alice")
    assert not revoke_key(path, "alice")
    with pytest.raises(ValueError, match=r"^key name 'alice' was used by a revoked key; pick another") as caught:
        create_key(path, "alice", rpm=3)  # it would inherit the old key's runs, usage and files
    assert "\n" not in str(caught.value)
    [info] = list_keys(path)
    assert info.revoked_at is not None and info.rpm is None
    with pytest.raises(ValueError, match=r"^key name 'anonymous' is reserved"):
        create_key(path, "anonymous")


def test_revoke_unknown_name_is_false_and_reading_a_missing_file_fails(tmp_path: Path) -> None:
    path = tmp_path / "keys.db"
    with pytest.raises(FileNotFoundError):
        list_keys(path)
    with pytest.raises(FileNotFoundError):
        revoke_key(path, "alice")
    assert not path.exists()
    create_key(path, "alice")
    assert not revoke_key(path, "nobody")


# The edge's store


async def test_store_authenticates_active_keys_only(tmp_path: Path) -> None:
    path = tmp_path / "keys.db"
    secret = create_key(path, "alice", rpm=5)
    store = KeyStore(path, refresh=0.05)
    await store.open()
    try:
        key = store.authenticate(secret)
        assert key is not None and (key.name, key.rpm, key.tpm, key.max_concurrent) == ("alice", 5, None, None)
        assert key.key_id == list_keys(path)[0].key_id
        assert len(store) == 1
        for wrong in ("", secret[:-1], secret + "x", "sk-other", SECRET_PREFIX + "x" * 1000):
            assert store.authenticate(wrong) is None
    finally:
        await store.aclose()


async def test_store_sees_revocations_and_new_keys_from_another_writer(tmp_path: Path) -> None:
    path = tmp_path / "keys.db"
    alice = create_key(path, "alice")
    store = KeyStore(path, refresh=0.05)
    await store.open()
    try:
        bob = create_key(path, "bob", max_concurrent=1)
        await assert_eventually(lambda: store.authenticate(bob) is not None, timeout=2)
        revoke_key(path, "alice")
        await assert_eventually(lambda: store.authenticate(alice) is None, timeout=2)
        assert len(store) == 1
    finally:
        await store.aclose()


async def test_a_poll_that_read_before_a_change_does_not_undo_the_reload_after_it(tmp_path: Path) -> None:
    """The console re-reads the keys after it makes one (reload); a poll whose read had begun before
    the change, finishing after that reload, put the older keys back for another refresh."""
    path = tmp_path / "keys.db"
    create_key(path, "alice")
    storage = SqliteKeyStorage(path)
    store = KeyStore(storage, refresh=3600)  # no poll of its own: the test is the poll
    await store.open()
    held, release = asyncio.Event(), asyncio.Event()
    read = storage.active

    async def slow_once() -> dict[str, ApiKey]:
        keys = await read()  # the keys before the change
        if not held.is_set():
            held.set()
            await release.wait()
        return keys

    try:
        create_key(path, "bob")  # a change the poll will see (a new counter) but read too early
        storage.active = slow_once  # type: ignore[method-assign]
        poll = asyncio.create_task(store._reload())
        await held.wait()
        carol = create_key(path, "carol")
        reload = asyncio.create_task(store.reload())  # waits for the poll's read to end, then reads
        await asyncio.sleep(0.05)
        release.set()
        await asyncio.gather(poll, reload)
        assert store.authenticate(carol) is not None
    finally:
        await store.aclose()


async def test_store_follows_a_replaced_file_and_keeps_its_keys_when_the_file_is_deleted(tmp_path: Path) -> None:
    path, other = tmp_path / "keys.db", tmp_path / "other.db"
    old = create_key(path, "alice")
    store = KeyStore(path, refresh=0.05)
    await store.open()
    try:
        new = create_key(other, "bob")
        other.replace(path)
        await assert_eventually(lambda: store.authenticate(new) is not None, timeout=2)
        assert store.authenticate(old) is None
        path.unlink()
        await asyncio.sleep(0.2)  # several refreshes: nothing to wait for, the point is that nothing happens
        assert store.authenticate(new) is not None and not path.exists()
    finally:
        await store.aclose()


async def test_store_creates_a_missing_file_empty(tmp_path: Path) -> None:
    path = tmp_path / "state" / "keys.db"
    store = KeyStore(path, refresh=0.05)
    await store.open()
    try:
        assert len(store) == 0 and path.is_file()
        secret = create_key(path, "alice")
        await assert_eventually(lambda: store.authenticate(secret) is not None, timeout=2)
    finally:
        await store.aclose()


async def test_store_refuses_a_file_that_is_not_a_key_file_naming_keys_path(tmp_path: Path) -> None:
    path = tmp_path / "keys.db"
    path.write_bytes(b"not a database, just some bytes" * 100)
    with pytest.raises(StartError, match=r"^keys_path: cannot use the key file"):
        await KeyStore(path).open()


# The limiter


def test_keys_without_limits_are_not_tracked() -> None:
    limiter = Limiter()
    leases = [limiter.acquire(_key(), now=0.0) for _ in range(1000)]
    assert len(limiter) == 0 and limiter.in_progress("alice") == 0
    for lease in leases:
        lease.release(tokens=10)


def test_max_concurrent_refuses_until_a_lease_is_released() -> None:
    limiter, key = Limiter(), _key(conc=2)
    first, _second = limiter.acquire(key, now=0.0), limiter.acquire(key, now=0.0)
    with pytest.raises(LimitExceeded) as caught:
        limiter.acquire(key, now=0.0)
    assert caught.value.limit == "max_concurrent" and caught.value.retry_after == 1.0
    assert "'alice'" in caught.value.message
    assert limiter.in_progress("alice") == 2
    first.release(now=1.0)
    assert limiter.in_progress("alice") == 1
    limiter.acquire(key, now=1.0)
    assert limiter.in_progress("alice") == 2


def test_release_is_idempotent() -> None:
    limiter, key = Limiter(), _key(conc=1, tpm=100)
    lease = limiter.acquire(key, now=0.0)
    lease.release(tokens=30, now=1.0)
    lease.release(tokens=30, now=1.0)
    assert limiter.in_progress("alice") == 0
    limiter.acquire(key, now=2.0).release(tokens=69, now=2.0)
    limiter.acquire(key, now=3.0)  # 99 tokens < 100: a second release would have made it 129


def test_rpm_refuses_until_the_oldest_request_leaves_the_window() -> None:
    limiter, key = Limiter(), _key(rpm=2)
    limiter.acquire(key, now=0.0).release(now=0.5)
    limiter.acquire(key, now=10.0).release(now=10.5)
    with pytest.raises(LimitExceeded) as caught:
        limiter.acquire(key, now=30.0)
    assert caught.value.limit == "rpm" and caught.value.retry_after == pytest.approx(30.0)
    assert "2 requests per minute" in caught.value.message
    with pytest.raises(LimitExceeded):
        limiter.acquire(key, now=59.9)
    limiter.acquire(key, now=60.0)  # the request at 0 has left
    with pytest.raises(LimitExceeded) as caught:
        limiter.acquire(key, now=61.0)
    assert caught.value.retry_after == pytest.approx(9.0)  # the one at 10 leaves at 70


def test_tpm_counts_released_tokens_over_the_window() -> None:
    limiter, key = Limiter(), _key(tpm=100)
    limiter.acquire(key, now=0.0).release(tokens=60, now=5.0)
    limiter.acquire(key, now=6.0).release(tokens=50, now=20.0)
    with pytest.raises(LimitExceeded) as caught:
        limiter.acquire(key, now=21.0)
    # 110 tokens: below 100 once the 60 recorded at 5 leave, at 65.
    assert caught.value.limit == "tpm" and caught.value.retry_after == pytest.approx(44.0)
    assert "100 tokens per minute" in caught.value.message
    limiter.acquire(key, now=65.0).release(tokens=0, now=65.0)


def test_tpm_waits_for_as_many_entries_as_needed() -> None:
    limiter, key = Limiter(), _key(tpm=100)
    for second, tokens in ((0.0, 40), (10.0, 40), (20.0, 40)):
        limiter.acquire(key, now=second).release(tokens=tokens, now=second)
    with pytest.raises(LimitExceeded) as caught:
        limiter.acquire(key, now=30.0)
    assert caught.value.retry_after == pytest.approx(30.0)  # 120 - 40 = 80 < 100 after the first leaves
    limiter.acquire(key, now=60.0)


def test_the_longest_wait_of_several_limits_is_reported() -> None:
    limiter, key = Limiter(), _key(rpm=1, conc=1)
    limiter.acquire(key, now=0.0)
    with pytest.raises(LimitExceeded) as caught:
        limiter.acquire(key, now=20.0)
    assert caught.value.limit == "rpm" and caught.value.retry_after == pytest.approx(40.0)


def test_windows_stay_bounded_under_a_burst() -> None:
    limiter, key = Limiter(), _key(tpm=10**9, rpm=10**9)
    for i in range(100_000):
        now = i * 0.0005  # 2000 requests a second for 50 s
        limiter.acquire(key, now=now).release(tokens=1, now=now)
    state = limiter._states["alice"]
    assert len(state.requests.entries) <= 601 and len(state.tokens.entries) <= 601
    assert state.requests.total == 100_000 and state.tokens.total == 100_000


def test_idle_state_is_dropped() -> None:
    limiter = Limiter()
    limiter.acquire(_key("only-concurrency", conc=3), now=0.0).release(now=0.0)
    assert len(limiter) == 0  # nothing left to remember
    limiter.acquire(_key("alice", rpm=5), now=0.0).release(tokens=10, now=1.0)
    running = limiter.acquire(_key("bob", rpm=5), now=0.0)  # in progress for longer than a minute
    assert len(limiter) == 2
    limiter.acquire(_key("carol", rpm=5), now=120.0)
    assert sorted(limiter._states) == ["bob", "carol"]
    assert limiter.in_progress("bob") == 1
    running.release(now=200.0)
    assert sorted(limiter._states) == ["carol"]  # bob's last request was long ago: dropped at once
    limiter.acquire(_key("dave", rpm=5), now=400.0)
    assert sorted(limiter._states) == ["carol", "dave"]  # carol is still in progress
