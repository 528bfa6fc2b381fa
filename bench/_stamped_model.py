"""P5's provider: the local model's SSE stream, each delta stamped with its send time.

Run as `python -m bench._stamped_model --word-delay S`; it prints `listening on URL`. Every
delta is ` <word>@<CLOCK_MONOTONIC ns>`: the clock is system-wide on Linux, so a client in
another process measures provider->client latency as its own monotonic_ns() minus the stamp.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid

from agent_server.local_model import last_user_text, numbered_events, reply_words
from agent_server.loopback_http import HttpRequest, HttpResponse, LoopbackHttpServer
from grpc_common import install_signal_handlers


class StampedModel:
    """Streams reply_words(user text) like the built-in model, one stamped delta at a time."""

    def __init__(self, word_delay: float, reply_length: int) -> None:
        self._word_delay = word_delay
        self._reply_length = reply_length

    async def handle(self, request: HttpRequest, response: HttpResponse) -> None:
        body = request.json()
        words = reply_words(last_user_text(body.get("input")))
        if self._reply_length:
            # As many words as asked for: the built-in reply, again and again.
            words = (words * (self._reply_length // len(words) + 1))[: self._reply_length]
        response_id = f"resp_{uuid.uuid4().hex}"
        item_id = f"msg_{uuid.uuid4().hex}"
        envelope = {"id": response_id, "object": "response", "model": body.get("model", "")}
        if body.get("stream") is not True:
            # P7's small non-streamed call: the whole response object at once.
            part = {"type": "output_text", "text": " ".join(words), "annotations": []}
            item = {"id": item_id, "type": "message", "role": "assistant", "content": [part]}
            whole = {**envelope, "status": "completed", "output": [item]}
            await response.send(200, json.dumps(whole).encode())
            return
        send = numbered_events(response)
        await response.start()
        await send("response.created", response={**envelope, "status": "in_progress"})
        item = {"id": item_id, "type": "message", "role": "assistant"}
        await send("response.output_item.added", output_index=0, item={**item, "content": []})
        sent = []
        for word in words:
            if self._word_delay:
                await asyncio.sleep(self._word_delay)
            delta = f"{word.strip()}@{time.monotonic_ns()} "
            sent.append(delta)
            await send(
                "response.output_text.delta",
                item_id=item_id,
                output_index=0,
                content_index=0,
                delta=delta,
            )
        part = {"type": "output_text", "text": "".join(sent), "annotations": []}
        await send(
            "response.output_item.done",
            output_index=0,
            item={**item, "status": "completed", "content": [part]},
        )
        usage = {"input_tokens": 1, "output_tokens": len(words), "total_tokens": len(words) + 1}
        await send(
            "response.completed", response={**envelope, "status": "completed", "usage": usage}
        )


async def _main(word_delay: float, reply_length: int) -> None:
    model = StampedModel(word_delay, reply_length)
    server = await LoopbackHttpServer.start(model.handle)
    stop = asyncio.Event()
    install_signal_handlers(stop.set)
    print(f"listening on {server.url}", flush=True)
    await stop.wait()
    await server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--word-delay", type=float, default=0.02)
    parser.add_argument(
        "--reply-length", type=int, default=0, help="words per reply (default: the built-in's)"
    )
    args = parser.parse_args()
    asyncio.run(_main(args.word_delay, args.reply_length))


if __name__ == "__main__":
    main()
