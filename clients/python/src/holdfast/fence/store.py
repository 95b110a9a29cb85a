"""A client of the reference fenced store (``holdfast fence-store``, proto/holdfast/v1/fence.proto): a
small durable key-value service that refuses tokens lower than the highest it has seen for a key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import grpc

from holdfast.errors import HoldfastError, InvalidArgument, Unavailable
from holdfast.fence import FenceStale
from holdfast.v1 import fence_pb2, fence_pb2_grpc


@dataclass(frozen=True)
class Value:
    value: bytes
    #: The token of the write that stored it.
    token: int


class FencedStore:
    """Reads and writes keys of a fenced store, each with the caller's fencing token."""

    def __init__(self, endpoint: str = "127.0.0.1:7301", *, timeout: float = 5.0) -> None:
        self._channel = grpc.insecure_channel(endpoint)
        self._stub = fence_pb2_grpc.FencedStoreStub(self._channel)  # type: ignore[no-untyped-call]
        self._timeout = timeout
        self.endpoint = endpoint

    def write(self, key: str, token: int, value: bytes) -> int:
        """Writes ``value`` under ``key`` if ``token`` is at least the key's mark; returns the new mark.
        Raises :class:`holdfast.fence.FenceStale` if a newer holder has been here."""
        try:
            r = self._stub.Write(
                fence_pb2.FencedWriteRequest(key=key, token=token, value=value), timeout=self._timeout
            )
        except grpc.RpcError as e:
            raise self._error(e, key, token) from None
        return int(r.mark)

    def read(self, key: str, token: int, *, shared: bool = False) -> Optional[Value]:
        """Reads ``key`` with ``token`` (raising the key's mark, so an older holder can no longer write);
        ``None`` if it was never written."""
        try:
            r = self._stub.Read(
                fence_pb2.FencedReadRequest(key=key, token=token, shared=shared), timeout=self._timeout
            )
        except grpc.RpcError as e:
            raise self._error(e, key, token) from None
        return Value(r.value, int(r.value_token)) if r.found else None

    def _error(self, e: grpc.RpcError, key: str, token: int) -> HoldfastError:
        details = e.details() or ""
        if e.code() == grpc.StatusCode.FAILED_PRECONDITION and "stale token" in details:
            seen = _seen(details)
            return FenceStale(key, token, seen)
        if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
            # A bad key, value or token: every retry would be refused alike (the Rust client's Invalid).
            return InvalidArgument(f"fenced store {self.endpoint}: {details}")
        return Unavailable(f"fenced store {self.endpoint}: {e.code().name}: {details}")

    def close(self) -> None:
        self._channel.close()


def _seen(message: str) -> int:
    """The mark in the store's "stale token T for K: the store has seen token N" message (0 if absent)."""
    tail = message.rsplit("token", 1)[-1]
    digits = "".join(c for c in tail if c.isdigit())
    return int(digits) if digits else 0
