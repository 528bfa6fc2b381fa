"""An EventBuffer subscription read as ThreadEvents: subscribe() yields what a subscriber sends."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from agent_server.events import EventBuffer
from rollout.agent.v1 import agent_pb2


class Subscription:
    """buffer.subscribe(after_index, flush_window), each message parsed back to its event."""

    def __init__(self, buffer: EventBuffer, after_index: int, flush_window: float = 0.0) -> None:
        self.messages: AsyncGenerator[bytes, None] = buffer.subscribe(after_index, flush_window)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> agent_pb2.ThreadEvent:
        return agent_pb2.StreamEventsResponse.FromString(await anext(self.messages)).event

    async def aclose(self) -> None:
        await self.messages.aclose()
