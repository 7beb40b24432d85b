"""A client that outlives its daemon never writes into, or reads from, the
old instance's arena: the restarted daemon refuses its offsets-based calls
with FAILED_PRECONDITION, and the client maps the new arena and goes on."""

from __future__ import annotations

import signal
import time

import grpc
import numpy as np
import pytest

from kvd import arena_protocol
from kvd.client import Client
from kvd.client._wire import spec_message
from kvd.testing.daemon import start_daemon
from kvd.v1 import kvd_pb2, kvd_pb2_grpc
from tests.integration.conftest import SMALL_SPEC, random_blocks


def until_reachable(call):
    """The channel reconnects to the new daemon with backoff: retry UNAVAILABLE for a while."""
    deadline = time.monotonic() + 20
    while True:
        try:
            return call()
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_a_client_remaps_the_arena_of_a_restarted_daemon(tmp_path):
    first = start_daemon(tmp_path)
    second = None
    try:
        with Client(first.unix_target, timeout_s=10) as client:
            namespace = client.register_namespace(SMALL_SPEC)
            keys = namespace.keys(np.arange(8 * SMALL_SPEC.block_tokens))
            blocks = random_blocks(SMALL_SPEC, 8, seed=5)
            assert client.put(namespace, keys[:4], blocks[:4]) == 4
            old_instance = client.session.arena.instance_id
            assert first.stop(signal.SIGTERM) == 0
            second = start_daemon(tmp_path)

            # Offsets of the new instance would land in the old arena: refused, precisely.
            stub = kvd_pb2_grpc.KvdStub(grpc.insecure_channel(second.unix_target))
            stub.RegisterNamespace(kvd_pb2.RegisterNamespaceRequest(spec=spec_message(SMALL_SPEC)), timeout=10)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Reserve(kvd_pb2.ReserveRequest(namespace_id=namespace.namespace_id, client_id="stale",
                                                    keys=keys[:1], arena_instance_id=old_instance), timeout=10)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert refused.value.details().startswith(arena_protocol.ARENA_CHANGED)

            # The client itself notices, maps the new arena and stores bit-exact bytes.
            until_reachable(lambda: client.register_namespace(SMALL_SPEC))
            assert client.put(namespace, keys, blocks) == 8
            assert client.session.arena.instance_id not in ("", old_instance)
        with Client(second.unix_target) as fresh:
            assert np.array_equal(fresh.get_numpy(namespace, keys), blocks)
            assert [ready for ready, _ in fresh.get_layers(namespace, keys)][-1] == SMALL_SPEC.num_layers

        # Reads too: a client that mapped the second instance's arena, across a third.
        with Client(second.unix_target, timeout_s=10) as reader:
            assert np.array_equal(reader.get_numpy(namespace, keys), blocks)
            assert second.stop(signal.SIGTERM) == 0
            second = start_daemon(tmp_path)
            until_reachable(lambda: reader.register_namespace(SMALL_SPEC))
            # Host memory only: the restart lost the blocks; the client maps the new arena and sees a miss.
            assert reader.get_numpy(namespace, keys).shape[0] == 0
            assert reader.put(namespace, keys, blocks) == 8
            layers = [(ready, got.copy()) for ready, got in reader.get_layers(namespace, keys)]
            assert np.array_equal(layers[-1][1], blocks)
    finally:
        for process in (first, second):
            if process is not None and process.process.poll() is None:
                process.stop(signal.SIGTERM)
