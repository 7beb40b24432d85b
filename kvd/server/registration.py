"""Registers the Kvd service on a gRPC server, parsing requests itself.

The generated `add_KvdServicer_to_server` parses each request with the
message's `FromString`. Bytes that are not a valid message (a truncated
field, a string that is not UTF-8) raise DecodeError inside grpc, which
answers UNKNOWN and puts the Python exception's name in the details. Here
the same methods are registered from the service descriptor, with a parser
that hands such bytes to the handler as `MalformedRequest`, and the handler
answers INVALID_ARGUMENT naming the message type: a client mistake gets a
precise status like every other (tests/fuzz sends raw bytes to every
method, and fuzzes these handlers in process with atheris).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvd.v1 import kvd_pb2

SERVICE_NAME = "kvd.v1.Kvd"


@dataclass(frozen=True, slots=True)
class MalformedRequest:
    """What the parser returns for bytes that are not the method's message."""

    message_type: str
    reason: str

    def details(self) -> str:
        return f"the request is not a valid {self.message_type} message: {self.reason}"


def _parser(message_class: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError as error:
            return MalformedRequest(message_class.DESCRIPTOR.full_name, str(error)[:200])

    return parse


def _unary(behavior: Callable, on_malformed: Callable[[str], None], method: str) -> Callable:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, MalformedRequest):
            on_malformed(method)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details())
        return await behavior(request, context)

    return handle


def _server_streaming(behavior: Callable, on_malformed: Callable[[str], None], method: str) -> Callable:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, MalformedRequest):
            on_malformed(method)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details())
        async for message in behavior(request, context):
            yield message

    return handle


def method_handlers(servicer: Any, on_malformed: Callable[[str], None]) -> dict[str, grpc.RpcMethodHandler]:
    """The handler of every method of kvd.v1.Kvd, served by `servicer`, by method name.

    on_malformed(method) is called for each request that failed to parse
    (the daemon counts it in kvd_rpc_total as INVALID_ARGUMENT).
    """
    handlers = {}
    for method in kvd_pb2.DESCRIPTOR.services_by_name["Kvd"].methods:
        request_class = getattr(kvd_pb2, method.input_type.name)
        response_class = getattr(kvd_pb2, method.output_type.name)
        behavior = getattr(servicer, method.name)
        if method.client_streaming:
            raise NotImplementedError(f"{method.name}: client-streaming methods are not registered here")
        if method.server_streaming:
            make_handler, wrap = grpc.unary_stream_rpc_method_handler, _server_streaming
        else:
            make_handler, wrap = grpc.unary_unary_rpc_method_handler, _unary
        handlers[method.name] = make_handler(
            wrap(behavior, on_malformed, method.name),
            request_deserializer=_parser(request_class),
            response_serializer=response_class.SerializeToString,
        )
    return handlers


def add_kvd_service(servicer: Any, server: grpc.aio.Server, on_malformed: Callable[[str], None]) -> None:
    """Register every method of kvd.v1.Kvd on `server` (see method_handlers)."""
    handlers = method_handlers(servicer, on_malformed)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
