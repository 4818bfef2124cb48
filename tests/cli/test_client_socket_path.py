"""A socket path over the AF_UNIX limit (107 bytes) is one line from every client command, the
same line as ``llmd serve``'s (``protocol.check_socket_path``), whether it comes from ``--socket``
or ``$LLMD_SOCKET``: the client checks the path it is given (``client.checked_socket_path``); it
raised ``OSError: AF_UNIX path too long`` from ``socket.connect`` as a traceback."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from serve_cli import one_error_line

from llmd.daemon.cli.main import main
from llmd.daemon.client.client import AsyncClient, Client
from llmd.daemon.core.errors import LlmdError
from llmd.daemon.protocol import check_socket_path

LONG = "/tmp/" + "x" * 120 + ".sock"
LINE = check_socket_path(LONG)  # what `llmd serve` and `llmd top` said already


@pytest.mark.parametrize("args", [["status"], ["ps"], ["stop"], ["top"], ["chat", "-p", "hi"],
                                  ["bench", "serve", "--num-requests", "1"]],
                         ids=lambda a: " ".join(a[:2]))
@pytest.mark.parametrize("via", ["--socket", "LLMD_SOCKET"])
def test_every_client_command_says_the_path_is_too_long_in_one_line(args, via):
    cli = [*args, "--socket", LONG] if via == "--socket" else args
    env = {"LLMD_SOCKET": LONG} if via == "LLMD_SOCKET" else {"LLMD_SOCKET": None}
    result = CliRunner().invoke(main, cli, env=env)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (result.output, result.exception)
    one_error_line(result.output, LINE)


def test_the_clients_check_the_path_they_are_given(monkeypatch):
    assert LINE.startswith(f"socket path is {len(LONG)} bytes, over the AF_UNIX limit of 107: {LONG}")
    for cls in (Client, AsyncClient):
        with pytest.raises(LlmdError, match="over the AF_UNIX limit of 107"):
            cls(LONG)
    monkeypatch.setenv("LLMD_SOCKET", LONG)
    with pytest.raises(LlmdError, match="over the AF_UNIX limit of 107"):
        Client()
    assert Client("/tmp/llmd-short.sock").socket_path == "/tmp/llmd-short.sock"
