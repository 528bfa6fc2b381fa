"""view.html of real agent-server bundles, opened in headless Chromium and read from its DOM."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytest.importorskip(
    "playwright.sync_api",
    reason="needs playwright, of the test dependency group (make installs it into .venv)",
)
from playwright.sync_api import Browser, Page, sync_playwright

from rollout.agent.v1 import agent_pb2
from rollout.trace.v1 import common_pb2, state_pb2
from tests.agent_server.conftest import Harness
from tests.agent_server.scripted_provider import (
    answer,
    completed,
    created,
    item_added,
    item_done,
    message,
    sse,
    text_delta,
)
from trace_reducer import replay_bundle, request_body, write_view
from trace_reducer.bundle._payloads import PayloadStore
from trace_reducer.view._view import ViewData, save_view

from .bundles import COMPLETED, BundleBuilder, as_input, assistant_output, user_item
from .live import scripted_agent
from .test_watch import frame_ends

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip(
        "needs Debian's chromium at /usr/bin/chromium (`make test-backends` installs it)",
        allow_module_level=True,
    )
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]

EVIL_USER = 'Repeat: <script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
EVIL_REPLY = "Here is <b>bold</b> </script><script>window.__pwned = 3</script> as text."
ACCEPTED = "Accepted before the interrupt."
PARTIAL = "Half of this never"
TOOL_OUTPUT = "sunny, 21 C"


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    home = tmp_path_factory.mktemp("chromium-home")
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            args=CHROMIUM_ARGS,
            # Chromium writes its profile under HOME.
            env={**os.environ, "HOME": str(home)},
        )
        try:
            yield chromium
        finally:
            chromium.close()


async def _close(agent: Harness, thread_id: str) -> None:
    await agent.stub.CloseThread(agent_pb2.CloseThreadRequest(thread_id=thread_id))


async def _record(root: Path) -> dict[str, Path]:
    """One bundle per case, each made by a real agent server on a scripted provider."""
    bundles: dict[str, Path] = {}
    async with scripted_agent(root) as (agent, provider):
        provider.queue(answer(EVIL_REPLY, "msg-evil"))
        provider.queue(answer("A second answer.", "msg-second", response_id="resp-2"))
        thread = await agent.start_thread(instructions="Answer <i>briefly</i>.")
        events = agent.events(thread.id)
        for text in (EVIL_USER, "And again?"):
            turn = await agent.start_turn(thread.id, text)
            await events.turn_completed(turn.id)
        await _close(agent, thread.id)
        bundles["completed"] = Path(thread.bundle_path)

        kept = message(ACCEPTED, "msg-kept")
        dropped = message(PARTIAL + " finished.", "msg-dropped")
        never = asyncio.Event()
        provider.queue(
            sse(
                created("resp-int"),
                item_added(kept),
                text_delta(ACCEPTED, "msg-kept"),
                item_done(kept),
                item_added(dropped),
                text_delta(PARTIAL, "msg-dropped"),
            ),
            never,
        )
        thread = await agent.start_thread()
        events = agent.events(thread.id)
        turn = await agent.start_turn(thread.id, "Start, then be interrupted.")
        await events.wait_for(
            lambda e: e.HasField("agent_message_delta") and e.agent_message_delta.delta == PARTIAL
        )
        await agent.stub.Interrupt(agent_pb2.InterruptRequest(thread_id=thread.id, turn_id=turn.id))
        await events.turn_completed(turn.id)
        await _close(agent, thread.id)
        bundles["interrupted"] = Path(thread.bundle_path)

        provider.queue_error(500, {"error": {"message": "the provider broke", "code": "boom"}})
        thread = await agent.start_thread()
        events = agent.events(thread.id)
        turn = await agent.start_turn(thread.id, "This one fails.")
        await events.turn_completed(turn.id)
        await _close(agent, thread.id)
        bundles["failed"] = Path(thread.bundle_path)

        weather = agent_pb2.FunctionTool(
            name="get_weather",
            parameters_json='{"type": "object", "properties": {"city": {"type": "string"}}}',
        )
        call = {
            "type": "function_call",
            "id": "fc-w",
            "call_id": "call-w",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        }
        provider.queue(
            sse(
                created("resp-t1"),
                item_added({**call, "arguments": ""}),
                item_done(call),
                completed("resp-t1"),
            )
        )
        provider.queue(answer("It is sunny in Paris.", "msg-w", response_id="resp-t2"))
        thread = await agent.start_thread(tools=[weather])
        events = agent.events(thread.id)
        turn = await agent.start_turn(thread.id, "Weather in Paris?")
        await events.wait_for(lambda e: e.HasField("tool_call_requested"))
        await agent.stub.SubmitToolOutputs(
            agent_pb2.SubmitToolOutputsRequest(
                thread_id=thread.id,
                turn_id=turn.id,
                outputs=[agent_pb2.ToolOutput(call_id="call-w", output=TOOL_OUTPUT)],
            )
        )
        await events.turn_completed(turn.id)
        await _close(agent, thread.id)
        bundles["tools"] = Path(thread.bundle_path)

    # A copy of the completed bundle, torn inside its third-to-last frame.
    truncated = root / "truncated"
    truncated.mkdir()
    data = (bundles["completed"] / "trace.binpb").read_bytes()
    ends = frame_ends(data)
    (truncated / "trace.binpb").write_bytes(data[: ends[-4] + (ends[-3] - ends[-4]) // 2])
    bundles["truncated"] = truncated
    return bundles


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return asyncio.run(_record(tmp_path_factory.mktemp("traces")))


@dataclass
class Opened:
    page: Page
    requests: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


OpenPage = Callable[[Path], Opened]


@pytest.fixture
def open_page(browser: Browser, tmp_path: Path) -> Iterator[OpenPage]:
    pages: list[Opened] = []

    def opener(path: Path) -> Opened:
        page = browser.new_page(viewport={"width": 1100, "height": 900})
        opened = Opened(page)
        page.on("request", lambda request: opened.requests.append(request.url))
        page.on("pageerror", lambda error: opened.errors.append(str(error)))
        page.on(
            "console",
            lambda msg: opened.errors.append(msg.text) if msg.type == "error" else None,
        )
        page.goto(path.resolve().as_uri())
        page.wait_for_selector("body[data-ready=true]")
        pages.append(opened)
        return opened

    yield opener
    for index, opened in enumerate(pages):
        # Kept beside the test's other files for whoever looks at a failure.
        opened.page.screenshot(path=str(tmp_path / f"page-{index}.png"), full_page=True)
        assert (tmp_path / f"page-{index}.png").stat().st_size > 0
        opened.page.close()
        # Nothing but the page itself was loaded, and its script ran without an error.
        assert all(url.startswith("file://") for url in opened.requests), opened.requests
        assert opened.errors == []


def _status(execution: state_pb2.Execution) -> str:
    return common_pb2.ExecutionStatus.Name(execution.status).removeprefix("EXECUTION_STATUS_")


def assert_statuses_shown(page: Page, trace: state_pb2.RolloutTrace) -> None:
    """Every turn and call shows its status, in words, on both tabs."""
    page.click("nav#tabs button[data-tab=transcript]")
    for turn_id, turn in trace.turns.items():
        badge = page.locator(f'.turn[data-turn-id="{turn_id}"] h2 .status')
        assert badge.get_attribute("data-status") == _status(turn.execution)
        assert _status(turn.execution) in badge.inner_text()
    page.click("nav#tabs button[data-tab=timeline]")
    for call_id, call in trace.inference_calls.items():
        row = page.locator(f'tr.call-row[data-call-id="{call_id}"]')
        assert row.get_attribute("data-status") == _status(call.execution)
        assert _status(call.execution) in row.locator(".status").inner_text()
    page.click("nav#tabs button[data-tab=transcript]")


def item_text(item: state_pb2.ConversationItem) -> str:
    return "".join(part.text for part in item.content)


def test_completed_turns_render_as_text(
    bundles: dict[str, Path], open_page: OpenPage, tmp_path: Path
) -> None:
    bundle = bundles["completed"]
    trace = replay_bundle(bundle)
    opened = open_page(write_view(bundle))
    page = opened.page
    thread = trace.threads[trace.root_thread_id]
    assert page.inner_text("#thread-id") == thread.thread_id
    assert page.inner_text(".model") == "test-model"
    assert page.inner_text(".producer") == f"{trace.producer_name} {trace.producer_version}"
    assert page.get_attribute("#integrity .status", "data-status") == "CLEAN"
    assert "yes" in page.inner_text("#recording-complete")
    for item_id in thread.conversation_item_ids:
        item = trace.conversation_items[item_id]
        shown = page.locator(f'.item[data-item-id="{item_id}"] .text').inner_text()
        assert shown == item_text(item)
    assert EVIL_USER in page.inner_text("#transcript")
    assert EVIL_REPLY in page.inner_text("#transcript")
    # The markup in the messages stayed text: nothing ran, nothing was parsed into elements.
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert page.locator("img").count() == 0
    assert page.locator("#transcript b").count() == 0
    # The page's own: two data blocks, the shared helpers, the page and its rollout panel.
    assert page.locator("script").count() == 5
    assert_statuses_shown(page, trace)
    # Read by colour as well as by text: a completed status is green, a cancelled one is not.
    colour = page.eval_on_selector(".turn h2 .status", "e => getComputedStyle(e).backgroundColor")
    assert colour == "rgb(218, 251, 225)"
    page.screenshot(path=str(tmp_path / "completed.png"), full_page=True)
    assert (tmp_path / "completed.png").stat().st_size > 10_000


def test_what_the_model_saw_and_the_exact_request_bodies(
    bundles: dict[str, Path], open_page: OpenPage
) -> None:
    for name, bundle in bundles.items():
        trace = replay_bundle(bundle)
        page = open_page(write_view(bundle)).page
        page.click("nav#tabs button[data-tab=timeline]")
        assert trace.inference_calls, name
        for call_id, call in trace.inference_calls.items():
            detail = page.locator(f'tr.detail-row[data-call-id="{call_id}"]')
            detail.locator("details.seen-details summary").click()
            detail.locator("ol.seen").wait_for()  # built when first opened
            seen = detail.locator("ol.seen li").evaluate_all(
                "items => items.map(li => li.dataset.itemId)"
            )
            assert seen == list(call.request_item_ids), (name, call_id)
            detail.locator("details.body-details summary").click()
            body = detail.locator("pre.body").inner_text()
            assert body == request_body(bundle, call_id).decode(), (name, call_id)


def test_an_interrupted_turn_keeps_what_was_accepted_and_marks_what_was_not(
    bundles: dict[str, Path], open_page: OpenPage
) -> None:
    bundle = bundles["interrupted"]
    trace = replay_bundle(bundle)
    page = open_page(write_view(bundle)).page
    (turn,) = trace.turns.values()
    assert _status(turn.execution) == "CANCELLED"
    assert_statuses_shown(page, trace)
    items = page.locator("#transcript .item").all_inner_texts()
    assert any(ACCEPTED in text for text in items)
    assert not any(PARTIAL in text for text in items)
    discarded = page.locator("#transcript .discarded")
    assert discarded.count() == 1
    assert "DISCARDED OUTPUT" in discarded.inner_text()
    assert discarded.locator(".text").inner_text() == PARTIAL
    interrupt = page.locator("#transcript .interrupt").inner_text()
    assert f"interrupt requested by {turn.interrupt.requested_by}" in interrupt
    assert turn.interrupt.requested_by.startswith("ipv4:127.0.0.1:")
    page.click("nav#tabs button[data-tab=timeline]")
    assert page.locator("#timeline .discarded .text").inner_text() == PARTIAL


def test_a_failed_provider_call_shows_its_error(
    bundles: dict[str, Path], open_page: OpenPage
) -> None:
    bundle = bundles["failed"]
    trace = replay_bundle(bundle)
    page = open_page(write_view(bundle)).page
    (call,) = trace.inference_calls.values()
    assert _status(call.execution) == "FAILED"
    assert_statuses_shown(page, trace)
    page.click("nav#tabs button[data-tab=timeline]")
    row = page.locator(f'tr.call-row[data-call-id="{call.inference_call_id}"]').inner_text()
    assert "HTTP 500" in row
    assert "the provider broke" in row
    colour = page.eval_on_selector(
        "tr.call-row .status", "e => getComputedStyle(e).backgroundColor"
    )
    assert colour == "rgb(255, 235, 233)"


def test_a_truncated_bundle_says_so(bundles: dict[str, Path], open_page: OpenPage) -> None:
    bundle = bundles["truncated"]
    trace = replay_bundle(bundle)
    assert trace.integrity.status == state_pb2.INTEGRITY_STATUS_TRUNCATED
    page = open_page(write_view(bundle)).page
    assert page.get_attribute("#integrity .status", "data-status") == "TRUNCATED"
    assert page.inner_text("#integrity-detail") == trace.integrity.detail
    assert "no" in page.inner_text("#recording-complete")
    assert_statuses_shown(page, trace)


def test_a_tool_round_trip_made_by_the_agent(bundles: dict[str, Path], open_page: OpenPage) -> None:
    bundle = bundles["tools"]
    trace = replay_bundle(bundle)
    [tool] = trace.tool_calls.values()
    page = open_page(write_view(bundle)).page
    assert_statuses_shown(page, trace)
    call_item = page.locator(f'.item[data-item-id="{tool.call_item_id}"]')
    assert call_item.locator(".tool-name code").inner_text() == "get_weather"
    assert '"city": "Paris"' in call_item.locator("pre.arguments").inner_text()
    assert call_item.locator(".status").get_attribute("data-status") == "COMPLETED"
    output = page.locator(f'.item[data-item-id="{tool.output_item_id}"]')
    assert output.locator("pre.output").inner_text() == TOOL_OUTPUT
    assert (
        f"output of tool call get_weather {tool.tool_call_id}"
        in output.locator(".prov").inner_text()
    )
    assert "It is sunny in Paris." in page.inner_text("#transcript")
    page.click("nav#tabs button[data-tab=timeline]")
    row = page.locator(f'tr.tool-row[data-tool-call-id="{tool.tool_call_id}"]')
    assert "get_weather" in row.inner_text()


def test_tool_calls_reasoning_and_refusals(tmp_path: Path, open_page: OpenPage) -> None:
    """Every kind of item at once, in a reduced state built by hand."""
    trace = state_pb2.RolloutTrace(trace_id="t-1", root_thread_id="thread-1")
    trace.integrity.status = state_pb2.INTEGRITY_STATUS_CLEAN
    trace.recording_complete = True
    done = common_pb2.EXECUTION_STATUS_COMPLETED
    thread = trace.threads["thread-1"]
    thread.thread_id = "thread-1"
    thread.model = "tool-model"
    thread.execution.status = done
    thread.turn_ids.append("turn-1")
    turn = trace.turns["turn-1"]
    turn.turn_id, turn.thread_id = "turn-1", "thread-1"
    turn.execution.status = done
    turn.inference_call_ids.extend(["call-1", "call-2"])
    turn.tool_call_ids.append("tool-1")

    def item(item_id: str, seq: int, **fields: object) -> state_pb2.ConversationItem:
        entry = trace.conversation_items[item_id]
        entry.MergeFrom(
            state_pb2.ConversationItem(
                item_id=item_id, thread_id="thread-1", turn_id="turn-1", first_seen_seq=seq
            )
        )
        entry.MergeFrom(state_pb2.ConversationItem(**fields))  # type: ignore[arg-type]
        thread.conversation_item_ids.append(item_id)
        return entry

    by_call = state_pb2.ProducerRef(
        inference=state_pb2.InferenceProducer(inference_call_id="call-1")
    )
    item(
        "item-1",
        2,
        role=state_pb2.CONVERSATION_ROLE_USER,
        kind=state_pb2.ITEM_KIND_MESSAGE,
        content=[state_pb2.ContentPart(type="input_text", text="Weather in Paris?")],
    )
    item(
        "item-2",
        5,
        kind=state_pb2.ITEM_KIND_REASONING,
        content=[state_pb2.ContentPart(type="summary_text", text="I should call the tool.")],
        produced_by=[by_call],
    )
    item(
        "item-3",
        6,
        kind=state_pb2.ITEM_KIND_FUNCTION_CALL,
        name="get_weather",
        call_id="fc-1",
        arguments='{"city": "Paris"}',
        produced_by=[by_call],
    )
    item(
        "item-4",
        9,
        role=state_pb2.CONVERSATION_ROLE_TOOL,
        kind=state_pb2.ITEM_KIND_FUNCTION_CALL_OUTPUT,
        call_id="fc-1",
        output='{"celsius": 21}',
        produced_by=[state_pb2.ProducerRef(tool=state_pb2.ToolProducer(tool_call_id="tool-1"))],
    )
    item(
        "item-5",
        12,
        role=state_pb2.CONVERSATION_ROLE_ASSISTANT,
        kind=state_pb2.ITEM_KIND_MESSAGE,
        content=[state_pb2.ContentPart(type="refusal", text="I cannot tell you that.")],
        produced_by=[
            state_pb2.ProducerRef(inference=state_pb2.InferenceProducer(inference_call_id="call-2"))
        ],
    )
    for call_id, started, ended, seen, accepted in (
        ("call-1", 3, 7, ["item-1"], ["item-2", "item-3"]),
        ("call-2", 10, 13, ["item-1", "item-2", "item-3", "item-4"], ["item-5"]),
    ):
        call = trace.inference_calls[call_id]
        call.inference_call_id, call.thread_id, call.turn_id = call_id, "thread-1", "turn-1"
        call.attempt = 1
        call.execution.status = done
        call.execution.started_seq, call.execution.ended_seq = started, ended
        call.request_item_ids.extend(seen)
        call.response_item_ids.extend(accepted)
    tool = trace.tool_calls["tool-1"]
    tool.tool_call_id, tool.call_id, tool.name = "tool-1", "fc-1", "get_weather"
    tool.turn_id, tool.thread_id = "turn-1", "thread-1"
    tool.requested_by_inference_call_id = "call-1"
    tool.call_item_id, tool.output_item_id = "item-3", "item-4"
    tool.execution.status = done
    tool.submitted_by = "ipv4:127.0.0.1:7777"
    path = save_view(ViewData(trace, PayloadStore()), tmp_path / "tools.html")
    page = open_page(path).page
    order = page.locator("#transcript .item").evaluate_all("xs => xs.map(x => x.dataset.itemId)")
    assert order == ["item-1", "item-2", "item-3", "item-4", "item-5"]
    call_item = page.locator('.item[data-item-id="item-3"]')
    assert call_item.locator(".who").inner_text().lower() == "tool call"
    assert call_item.locator(".tool-name code").inner_text() == "get_weather"
    assert '"city": "Paris"' in call_item.locator("pre.arguments").inner_text()
    assert call_item.locator(".status").get_attribute("data-status") == "COMPLETED"
    assert "ipv4:127.0.0.1:7777" in call_item.inner_text()
    output = page.locator('.item[data-item-id="item-4"]')
    assert output.locator(".who").inner_text().lower() == "tool output"
    assert output.locator("pre.output").inner_text() == '{"celsius": 21}'
    assert "output of tool call get_weather tool-1" in output.locator(".prov").inner_text()
    assert page.locator('.item[data-item-id="item-2"] .who').inner_text().lower() == "reasoning"
    refusal = page.locator('.item[data-item-id="item-5"] .part-refusal')
    assert refusal.locator(".part-label").inner_text().lower() == "refusal"
    assert refusal.locator(".text").inner_text() == "I cannot tell you that."
    page.click("nav#tabs button[data-tab=timeline]")
    tool_row = page.locator('tr.tool-row[data-tool-call-id="tool-1"]').inner_text()
    assert "get_weather" in tool_row
    assert "COMPLETED" in tool_row


def test_a_long_rollout_is_paginated(tmp_path: Path, open_page: OpenPage) -> None:
    bundle = BundleBuilder(tmp_path)
    sent = 0  # inputs of the previous call, which the next one repeats
    carried: list[dict[str, object]] = []  # the previous answer, sent back as input
    for number in range(1, 61):
        question = user_item(f"question {number}")
        turn = bundle.turn(f"turn-{number}", [question])
        call = bundle.call(turn, f"call-{number}", [*carried, question], prefix=sent)
        sent += len(carried) + 1
        item = bundle.added(call, f"msg-{number}")
        bundle.delta(call, f"answer {number}")
        output = assistant_output(f"answer {number}", f"msg-{number}")
        bundle.done(call, item, output)
        bundle.call_ended(call, COMPLETED)
        bundle.turn_ended(turn, COMPLETED)
        carried = [as_input(output, f"msg-{number}")]
    bundle.thread_ended()
    path = bundle.close()
    trace = replay_bundle(path)
    page = open_page(write_view(path)).page
    assert page.locator("#transcript .turn").count() == 25
    assert "page 1 of 3" in page.inner_text(".pager .page-info")
    page.locator(".pager button.next").first.click()
    assert page.locator("#transcript .turn h2").first.inner_text().startswith("Turn 26")
    # From the last call's "what the model saw", back to the first question on page 1.
    page.locator(".pager input").first.fill("3")
    page.locator(".pager input").first.dispatch_event("change")
    page.click("nav#tabs button[data-tab=timeline]")
    detail = page.locator('tr.detail-row[data-call-id="call-60"]')
    detail.locator("details.seen-details summary").click()
    detail.locator("ol.seen").wait_for()
    seen = trace.inference_calls["call-60"].request_item_ids
    assert detail.locator("ol.seen li").count() == len(seen) == 119
    first_item = trace.turns["turn-1"].input_item_ids[0]
    detail.locator(f'li[data-item-id="{first_item}"] a.jump').click()
    assert "page 1 of 3" in page.inner_text(".pager .page-info")
    assert page.locator(f"#item-{first_item}").is_visible()
    assert page.locator(f"#item-{first_item} .text").inner_text() == "question 1"
