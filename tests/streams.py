"""A server-streaming call read in the background, its messages awaited by predicate."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, Callable
from typing import Any, Generic, TypeVar

import grpc

T = TypeVar("T")


class StreamLog(Generic[T]):
    """Every message of one streaming call, in order; wait_for finds one seen or to come."""

    def __init__(
        self,
        call: Any,
        messages: AsyncIterable[T] | None = None,
        *,
        deadline: float | None = None,
    ) -> None:
        """Read call (or messages drawn from it); close() cancels call."""
        self.call = call
        self.items: list[T] = []
        self.ended = False
        self.error: grpc.aio.AioRpcError | None = None
        self._deadline = deadline
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._pump(call if messages is None else messages))

    async def _pump(self, messages: AsyncIterable[T]) -> None:
        try:
            async for message in messages:
                self.items.append(message)
                self._changed.set()
        except grpc.aio.AioRpcError as error:
            self.error = error
        finally:
            self.ended = True
            self._changed.set()

    async def wait_for(self, predicate: Callable[[T], bool]) -> T:
        """The first message (seen or still to come) matching predicate."""
        checked = 0
        async with asyncio.timeout(self._deadline):
            while True:
                for message in self.items[checked:]:
                    if predicate(message):
                        return message
                checked = len(self.items)
                if self.ended:
                    raise AssertionError(f"the stream ended without it; error={self.error}")
                self._changed.clear()
                await self._changed.wait()

    async def until_end(self) -> list[T]:
        async with asyncio.timeout(self._deadline):
            await self._task
        return self.items

    async def close(self) -> None:
        self.call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
