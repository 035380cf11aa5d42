"""``iop``'s parser: an admin command built alone reads its arguments as the whole tree does."""

from __future__ import annotations

import pytest

from iop_cli.main import _command, _parser

ADMIN = [
    ["nodes", "ls", "--json", "--control-plane", "10.0.0.5:7400"],
    ["--log-level", "debug", "nodes", "drain", "n1", "--reason", "disk"],
    ["policy", "apply", "p.yaml", "--certs", "c", "--server-name", "cp"],
    ["join-token", "create", "--ttl", "2h", "--uses", "3"],
    ["batches", "show", "b1", "--worker", "127.0.0.1:7402", "--json"],
]


@pytest.mark.parametrize("argv", ADMIN)
def test_an_admin_command_parsed_alone_reads_as_in_the_whole_tree(argv: list[str]) -> None:
    command = _command(argv)
    assert command == next(word for word in argv if word in ("nodes", "policy", "join-token", "batches"))
    alone, whole = _parser(command).parse_args(argv), _parser().parse_args(argv)
    assert vars(alone) == vars(whole) and vars(alone)["logs"] is False


def test_the_command_is_found_only_after_nothing_but_the_log_level() -> None:
    assert _command(["--log-level", "info", "policy", "show"]) == "policy"
    assert _command(["--version"]) is None
    assert _command(["--log-level=info", "nodes", "ls"]) is None  # the whole tree: slower, still right
    assert _command([]) is None
    assert vars(_parser(_command(["up"])).parse_args(["up"]))["logs"] is True
