"""How a client dials a daemon: the channel's options, TLS to a TCP listener, and the
bearer token every call carries."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

CHANNEL_MESSAGE_BYTES = 1 << 30
# The bearer token when a client is given none (a daemon with auth.mode = "token").
TOKEN_ENV = "KVD_TOKEN"
RECONNECT_BACKOFF_MS = (100, 2_000)  # first and longest wait before dialling a lost daemon again
# How long one connection attempt may take to its HTTP/2 handshake. gRPC's C core reads it from
# grpc.min_reconnect_backoff_ms: at 100 ms a daemon busy for a moment (or a TLS handshake) failed
# calls with UNAVAILABLE, "timed out before receiving SETTINGS frame". A refused or absent socket
# still fails at once; a peer whose packets are dropped is dialled again after this long.
CONNECT_TIMEOUT_MS = 2_000


def channel_options() -> list[tuple[str, int]]:
    # The daemon enforces its own, smaller limit and names it in its error;
    # the client only refuses absurd sizes.
    return [
        ("grpc.max_receive_message_length", CHANNEL_MESSAGE_BYTES),
        ("grpc.max_send_message_length", CHANNEL_MESSAGE_BYTES),
        # The daemon is on this node: after it restarts, dial again within
        # seconds, not after gRPC's default backoff of up to two minutes
        # (an engine's connector would miss every request meanwhile).
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
        ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
    ]


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """TLS to a daemon's TCP listener (server.tls_cert_file), as PEM files.

    ca_file: the CAs to trust (None: the system's). cert_file and key_file:
    this client's certificate chain and key, for a daemon that requires
    them (server.tls_client_ca_file). server_name: the name to check the
    daemon's certificate for, when it is not the target's host.
    """

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("TlsConfig needs both cert_file and key_file, or neither")
        return grpc.ssl_channel_credentials(read(self.ca_file), read(self.key_file), read(self.cert_file))

    def options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def channel_arguments(tls: TlsConfig | None) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, Any]]]:
    """(credentials or None for a plaintext channel, channel options)."""
    if tls is None:
        return None, channel_options()
    return tls.credentials(), channel_options() + tls.options()


def resolve_token(token: str | None) -> str | None:
    """The bearer token: the one given, else $KVD_TOKEN, else None."""
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    return token or None


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The metadata every call carries: the bearer token, if any (else $KVD_TOKEN)."""
    token = resolve_token(token)
    return (("authorization", f"Bearer {token}"),) if token else None
