"""The one set of enum-to-word maps: how a value of the schema's enums reads as a word.

Every surface that shows an enum to a person or writes it as text (the viewer, `watch`, the
tables, the OTel spans, the RL export, the CLI) takes its word from here; docs/vocabulary.md
says which surface shows which.
"""

from __future__ import annotations

from collections.abc import Iterable

from rollout.trace.v1 import common_pb2, state_pb2


def enum_words(
    values: Iterable[tuple[str, int]], prefix: str, *, lower: bool = False
) -> dict[int, str]:
    """Each value's name without the enum's prefix (`EXECUTION_STATUS_COMPLETED` → `COMPLETED`)."""
    return {
        number: name.removeprefix(prefix).lower() if lower else name.removeprefix(prefix)
        for name, number in values
    }


# COMPLETED, FAILED, CANCELLED, RUNNING, ABORTED, UNSPECIFIED.
EXECUTION_WORDS = enum_words(common_pb2.ExecutionStatus.items(), "EXECUTION_STATUS_")
# CLEAN, UNCLOSED, TRUNCATED, CORRUPT, UNSPECIFIED.
INTEGRITY_WORDS = enum_words(state_pb2.IntegrityStatus.items(), "INTEGRITY_STATUS_")
# user, assistant, system, developer, tool: the words the Responses and Chat APIs use (no
# word for UNSPECIFIED: each surface says what an item without a role is shown as).
ROLE_WORDS = {
    number: word
    for number, word in enum_words(
        state_pb2.ConversationRole.items(), "CONVERSATION_ROLE_", lower=True
    ).items()
    if number != state_pb2.CONVERSATION_ROLE_UNSPECIFIED
}
# message, function_call, function_call_output, reasoning, ... and unspecified.
KIND_WORDS = enum_words(state_pb2.ItemKind.items(), "ITEM_KIND_", lower=True)
# completed, length, interrupted, provider_error, infra_error, ... and unspecified.
STOP_WORDS = enum_words(common_pb2.StopReason.items(), "STOP_REASON_", lower=True)


# completed, failed, cancelled, running, aborted, unspecified: `list`'s words for a rollout.
OUTCOME_WORDS = enum_words(common_pb2.ExecutionStatus.items(), "EXECUTION_STATUS_", lower=True)


def rollout_outcome(trace: state_pb2.RolloutTrace) -> str:
    """How the bundle's rollout went, in OUTCOME_WORDS: its last turn's status (a thread
    without turns: its own). `list` shows it; the RL export writes it beside the last call's
    stop reason, which says only how the model's last answer ended (a turn whose tool outputs
    never came failed after a completed call)."""
    thread = trace.threads.get(trace.root_thread_id)
    if thread is None:
        return OUTCOME_WORDS[common_pb2.EXECUTION_STATUS_UNSPECIFIED]
    turns = [trace.turns[t] for t in thread.turn_ids if t in trace.turns]
    status = turns[-1].execution.status if turns else thread.execution.status
    return OUTCOME_WORDS.get(status, OUTCOME_WORDS[common_pb2.EXECUTION_STATUS_UNSPECIFIED])


def rollout_group(trace: state_pb2.RolloutTrace) -> tuple[str, int]:
    """The GRPO group of the bundle's thread and its place in it, as export-rl's samples and
    reduce-all's tables give them: a fork's group id and repetition index; a thread that was
    not forked is a group of one, its own thread id (repetition 0)."""
    return trace.fork.group_id or trace.root_thread_id, trace.fork.repetition_index


def execution_word(status: common_pb2.ExecutionStatus.ValueType) -> str:
    return EXECUTION_WORDS.get(status, "UNSPECIFIED")


def integrity_word(status: state_pb2.IntegrityStatus.ValueType) -> str:
    return INTEGRITY_WORDS.get(status, "UNSPECIFIED")


def counted(count: int, noun: str, many: str | None = None) -> str:
    """`1 call`, `1,500 calls`: a count and its noun, in the plural (`many`, else noun + s)
    unless it is one; the CLI's reports say their counts so."""
    return f"{count:,} {noun if count == 1 else many or noun + 's'}"
