"""The device plane's calls (an engine's pools, kvd-driven SaveLayers and LoadLayers) and
placement planning (PlanPlacement, ReportStep); kvd.client.device.DevicePool is the
engine's side of a pool. See kvd.client._ops for how an operation runs."""

from __future__ import annotations

from collections.abc import Sequence

from kvd.client._ops import Op, Session
from kvd.client._wire import Namespace
from kvd.v1 import kvd_pb2


def register_pool(session: Session, namespace: Namespace, layers: Sequence[bytes], num_blocks: int, flags: bytes,
                  lease_ms: int, page_stride: int = 0, v_offset: int = 0, io_ring: bool = False) -> Op:
    response = yield ("RegisterPool", kvd_pb2.RegisterPoolRequest(
        namespace_id=namespace.namespace_id, client_id=session.client_id, layers=layers, num_blocks=num_blocks,
        flags=flags, lease_ms=lease_ms, page_stride_bytes=page_stride, v_offset_bytes=v_offset, io_ring=io_ring))
    return response


def unregister_pool(session: Session, pool_id: int) -> Op:
    yield ("UnregisterPool", kvd_pb2.UnregisterPoolRequest(client_id=session.client_id, pool_id=pool_id))


def save_layers(session: Session, namespace: Namespace, pool_id: int, keys: Sequence[bytes], pages: Sequence[int],
                engine_flag: int, kvd_flag: int, base: int, parent_key: bytes, offload_distance: int) -> Op:
    response = yield ("SaveLayers", kvd_pb2.SaveLayersRequest(
        namespace_id=namespace.namespace_id, client_id=session.client_id, pool_id=pool_id, parent_key=parent_key,
        keys=keys, pages=pages, engine_flag=engine_flag, kvd_flag=kvd_flag, base=base,
        offload_distance=offload_distance))
    return response


def load_layers(session: Session, namespace: Namespace, pool_id: int, keys: Sequence[bytes], pages: Sequence[int],
                kvd_flag: int, base: int, parent_key: bytes, cancel_flag: int | None = None) -> Op:
    response = yield ("LoadLayers", kvd_pb2.LoadLayersRequest(
        namespace_id=namespace.namespace_id, client_id=session.client_id, pool_id=pool_id, parent_key=parent_key,
        keys=keys, pages=pages, kvd_flag=kvd_flag, base=base, cancel_flag=cancel_flag))
    return response


def plan_placement(session: Session, request: kvd_pb2.PlanPlacementRequest) -> Op:
    return (yield ("PlanPlacement", request))


def report_step(session: Session, request: kvd_pb2.ReportStepRequest) -> Op:
    return (yield ("ReportStep", request))
