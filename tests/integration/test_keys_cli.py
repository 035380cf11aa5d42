"""``iop keys create|ls|revoke`` as real processes, against a key file named by --db, --config or --dir."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import yaml

from iop_edge.keys import SECRET_PREFIX, KeyStore, list_keys

IOP = [sys.executable, "-m", "iop_cli.main"]


def _keys(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*IOP, "keys", *args], capture_output=True, text=True, timeout=60, check=False)


def _edge_yaml(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "edge.yaml"
    path.write_text(yaml.safe_dump({"keys_path": "keys.db", "control_plane": {"address": "127.0.0.1:7400"}}))
    return path


def test_create_prints_the_secret_once_and_ls_and_revoke_follow(tmp_path: Path) -> None:
    db = str(tmp_path / "keys.db")
    created = _keys("create", "alice", "--rpm", "60", "--tpm", "10000", "--max-concurrent", "4", "--db", db)
    assert created.returncode == 0, created.stderr
    secret = created.stdout.strip()
    assert created.stdout == secret + "\n" and secret.startswith(SECRET_PREFIX)
    assert "only time" in created.stderr and secret not in created.stderr

    table = _keys("ls", "--db", db)
    assert table.returncode == 0 and secret not in table.stdout
    header, row = table.stdout.splitlines()
    assert header.split() == ["NAME", "KEY", "ID", "CREATED", "RPM", "TPM", "MAX-CONCURRENT", "ADMIN", "STATUS"]
    assert row.split()[0] == "alice" and row.split()[-5:] == ["60", "10000", "4", "no", "active"]

    revoked = _keys("revoke", "alice", "--db", db)
    assert (revoked.returncode, revoked.stdout) == (0, "key alice revoked\n")
    [info] = json.loads(_keys("ls", "--json", "--db", db).stdout)
    assert info["name"] == "alice" and info["status"] == "revoked" and info["revoked_at"] is not None
    assert (info["rpm"], info["tpm"], info["max_concurrent"], info["admin"]) == (60, 10000, 4, False)


def test_admin_keys_are_made_with_admin_and_listed_as_such(tmp_path: Path) -> None:
    db = str(tmp_path / "keys.db")
    created = _keys("create", "ops", "--admin", "--db", db)
    assert created.returncode == 0 and "admin key ops created" in created.stderr
    assert _keys("create", "team", "--db", db).returncode == 0
    rows = [line.split() for line in _keys("ls", "--db", db).stdout.splitlines()[1:]]
    assert [(row[0], row[-2]) for row in rows] == [("ops", "yes"), ("team", "no")]
    assert [(key.name, key.admin) for key in list_keys(tmp_path / "keys.db")] == [("ops", True), ("team", False)]


def test_config_and_dir_take_keys_path_from_edge_yaml(tmp_path: Path) -> None:
    config = _edge_yaml(tmp_path / "state")
    assert _keys("create", "alice", "--config", str(config)).returncode == 0
    assert _keys("create", "bob", "--dir", str(tmp_path / "state")).returncode == 0
    assert [key.name for key in list_keys(tmp_path / "state" / "keys.db")] == ["alice", "bob"]
    assert not (tmp_path / "state" / "edge-keys.db").exists()


def test_dir_without_edge_yaml_uses_edge_keys_db(tmp_path: Path) -> None:
    assert _keys("create", "alice", "--dir", str(tmp_path / "state")).returncode == 0
    assert [key.name for key in list_keys(tmp_path / "state" / "edge-keys.db")] == ["alice"]


async def _empty_key_file(path: Path) -> None:
    store = KeyStore(path)  # as a starting edge makes it
    await store.open()
    await store.aclose()


def test_ls_says_no_keys_and_lists_revoked_ones(tmp_path: Path) -> None:
    empty = tmp_path / "keys.db"
    asyncio.run(_empty_key_file(empty))
    assert _keys("ls", "--db", str(empty)).stdout == "no keys\n"
    assert _keys("ls", "--json", "--db", str(empty)).stdout == "[]\n"
    assert _keys("create", "x", "--db", str(empty)).returncode == 0
    assert _keys("revoke", "x", "--db", str(empty)).returncode == 0
    shown = _keys("ls", "--db", str(empty))  # revoked keys stay listed
    assert shown.returncode == 0 and shown.stdout.splitlines()[1].split()[::7] == ["x", "revoked"]


def test_errors_are_one_line_with_the_right_exit_code(tmp_path: Path) -> None:
    db = str(tmp_path / "keys.db")
    assert _keys("create", "alice", "--db", db).returncode == 0
    assert _keys("create", "gone", "--db", db).returncode == 0
    assert _keys("revoke", "gone", "--db", db).returncode == 0
    cases = [
        (("create", "alice", "--db", db), 2, "iop keys: key 'alice' exists"),
        (("create", "gone", "--db", db), 2, "iop keys: key name 'gone' was used by a revoked key; pick another"),
        (("create", "anonymous", "--db", db), 2, "iop keys: key name 'anonymous' is reserved"),
        (("create", "bob", "--rpm", "0", "--db", db), 2, "iop keys: --rpm must be at least 1, not 0"),
        (("create", "bad name", "--db", db), 2, "iop keys: key name 'bad name'"),
        (("revoke", "nobody", "--db", db), 1, "iop keys: no key 'nobody'"),
        (("ls", "--db", str(tmp_path / "missing.db")), 2, "iop keys: no key file at"),
        (("revoke", "alice", "--dir", str(tmp_path / "nowhere")), 2, "iop keys: no key file at"),
    ]
    for args, code, start in cases:
        result = _keys(*args)
        assert result.returncode == code, (args, result.stderr)
        assert result.stderr.startswith(start) and result.stderr.count("\n") == 1, (args, result.stderr)
        assert result.stdout == ""
    assert not (tmp_path / "missing.db").exists()


def test_a_bad_config_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "edge.yaml"
    config.write_text(yaml.safe_dump({"keys_path": "keys.db", "http": {"port": "not a port"}}))
    result = _keys("ls", "--config", str(config))
    assert result.returncode == 2 and result.stderr.startswith("iop keys: bad config: ")
    assert result.stderr.count("\n") == 1
