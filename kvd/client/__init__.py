"""kvd client library.

    from kvd.client import Client
    from kvd.core.keys import NamespaceSpec, DType

    with Client("unix:///path/to/state/kvd.sock") as client:
        ns = client.register_namespace(NamespaceSpec(model_id="m", num_layers=32, num_kv_heads=8,
                                                     head_dim=128, block_tokens=16, kv_dtype=DType.BFLOAT16))
        keys = ns.keys(token_ids)                 # chained keys of the full blocks
        hit = client.lookup(ns, keys).matched     # longest stored prefix
        client.prefetch(ns, keys)                 # read what is only on disk into memory, ahead of the Get
        client.put(ns, keys, blocks)              # (len(keys), *ns.spec.block_shape), the namespace dtype
        kv = client.get_tensor(ns, keys)          # (matched, *block_shape) torch tensor
        got = client.get(ns, keys)                # got.blocks (numpy), got.corrupt: the next block
                                                  # failed its checksum (gone), not merely unstored

Block layout: (num_layers, 2, *inner) per block, layer-major, so one layer of
one block is contiguous; inner is (block_tokens, kv_heads, head_dim) or
(kv_heads, block_tokens, head_dim) as the namespace's inner_layout says.
Payloads move through the daemon's shared-memory arena when the client can
map it (same host, same user) and inline over gRPC otherwise.

A daemon with auth.mode = "token" wants a tenant's token: `Client(target,
token=...)` (default: $KVD_TOKEN); a TCP listener with TLS wants
`tls=TlsConfig(ca_file=..., cert_file=..., key_file=...)` (the last two for
mutual TLS).

Operators (an admin token): `client.namespaces()` lists every namespace with
its spec and blocks per tier; `client.delete_namespace("llama-3-8b")` removes
every block of the one a model_id, an id or an id prefix names
(kvd.client.namespaces).

KV events (stored / removed / tier-changed, for KV-aware routers):
`client.event_snapshot(ns)` and `client.watch_events(ns, from_sequence)`,
with `BlockMirror` to keep a copy of a namespace; see kvd.client.events.
"""

from kvd.client._channel import TlsConfig
from kvd.client._wire import ClusterLookupResult, GetResult, LookupResult, Namespace, NodeMatch, PrefetchResult
from kvd.client.aio import AsyncClient
from kvd.client.errors import NotDurableError
from kvd.client.namespaces import AmbiguousNamespace, NamespaceDeleted, NamespaceInfo, TierUsage
from kvd.client.events import BlockMirror, EventKind, EventSnapshot, KvEvent, ResyncRequired
from kvd.client.sync import Client

__all__ = [
    "AmbiguousNamespace", "AsyncClient", "BlockMirror", "Client", "ClusterLookupResult", "EventKind", "EventSnapshot",
    "GetResult", "KvEvent", "LookupResult", "Namespace", "NamespaceDeleted", "NamespaceInfo", "NodeMatch",
    "NotDurableError", "PrefetchResult", "ResyncRequired", "TierUsage", "TlsConfig",
]
