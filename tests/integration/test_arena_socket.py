"""The arena socket under abuse: whatever bytes arrive, a precise refusal or
the arena, never a crash, and a client that stalls delays nobody else."""

from __future__ import annotations

import json
import os
import socket

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvd import arena_protocol
from kvd.client import Client
from tests.integration.conftest import SMALL_SPEC, random_blocks


def exchange(path: str, payload: bytes) -> tuple[dict, list[int]]:
    with socket.socket(socket.AF_UNIX) as connection:
        connection.settimeout(10)
        connection.connect(path)
        connection.sendall(payload)
        connection.shutdown(socket.SHUT_WR)
        reply, fds, _flags, _address = socket.recv_fds(connection, 4096, 4)
    return json.loads(reply), fds


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=st.one_of(
    st.binary(max_size=300),
    st.builds(lambda text: text.encode() + b"\n", st.text(max_size=200)),
    st.builds(lambda value: json.dumps(value).encode() + b"\n",
              st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner,
                                                                                       max_size=3),
                           max_leaves=8)),
))
def test_any_request_gets_a_refusal_or_the_arena(daemon, payload):
    reply, fds = exchange(daemon.arena_socket, payload)
    try:
        if reply["ok"]:
            # Without tokens any JSON object asks well (an instance_id, if any, must be this one).
            request = json.loads(payload)
            assert isinstance(request, dict)
            assert request.get("instance_id") in (None, "", reply["instance_id"])
            assert len(fds) == 1 and os.fstat(fds[0]).st_size == reply["arena_bytes"]
        else:
            assert reply["code"] in ("INVALID_ARGUMENT", "FAILED_PRECONDITION") and reply["message"]
            assert fds == []
    finally:
        for fd in fds:
            os.close(fd)


def test_an_oversized_request_is_refused(daemon):
    reply, fds = exchange(daemon.arena_socket, b"{" + b" " * (arena_protocol.MAX_REQUEST_BYTES + 10))
    assert (reply["code"], fds) == ("INVALID_ARGUMENT", [])


def test_stalled_connections_block_nobody_and_are_dropped_in_time(tmp_path):
    """Twenty connections that say nothing, then a client: it is served while
    every stalled connection is still open, so it never waited for them
    (no clock: the daemon's request timeout is 30 s here, and the order of
    events is what is checked). Then, at a 0.2 s timeout, a stalled
    connection is dropped."""
    from kvd.testing.daemon import run_daemon

    for timeout_s, check in ((30.0, "served first"), (0.2, "dropped")):
        config = {"server": {"arena_request_timeout_s": timeout_s}}
        with run_daemon(tmp_path / check.replace(" ", "-"), config=config) as daemon:
            stalled = []
            try:
                for _ in range(20):  # connect and say nothing
                    connection = socket.socket(socket.AF_UNIX)
                    connection.connect(daemon.arena_socket)
                    stalled.append(connection)
                if check == "dropped":
                    stalled[0].settimeout(60)
                    assert stalled[0].recv(16) == b""  # the daemon closed it
                    continue
                with Client(daemon.unix_target) as client:
                    assert client.uses_shared_memory
                    namespace = client.register_namespace(SMALL_SPEC)
                    keys = namespace.keys(np.arange(2 * SMALL_SPEC.block_tokens) + 77_000)
                    blocks = random_blocks(SMALL_SPEC, 2, seed=77)
                    assert client.put(namespace, keys, blocks) == 2
                    assert np.array_equal(client.get_numpy(namespace, keys), blocks)
                for connection in stalled:
                    connection.setblocking(False)
                    try:
                        connection.recv(16)
                        raise AssertionError("a stalled connection was answered or closed first")
                    except BlockingIOError:
                        pass  # still open, still waiting: the client did not queue behind it
            finally:
                for connection in stalled:
                    connection.close()
