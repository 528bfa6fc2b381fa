"""A thread's and turn's times as the API carries them."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta, timezone

from google.protobuf import timestamp_pb2

from agent_server.threads import timestamp


def test_a_timestamp_is_what_from_datetime_makes() -> None:
    rng = random.Random(4)
    moments = [
        datetime(1970, 1, 1, tzinfo=UTC),
        datetime(1969, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC),
        datetime(1900, 3, 4, 5, 6, 7, 891_011, tzinfo=UTC),
        datetime(2026, 12, 6, 14, 0, 0, 1, tzinfo=timezone(timedelta(hours=-5, minutes=-30))),
        datetime(2026, 12, 6, 14, 0, 0, 500_000),  # naive: taken as UTC, as FromDatetime does
        datetime.now(UTC),
    ]
    moments += [
        datetime(1, 1, 1, tzinfo=UTC) + timedelta(microseconds=rng.randrange(10**17))
        for _ in range(500)
    ]
    for moment in moments:
        expected = timestamp_pb2.Timestamp()
        expected.FromDatetime(moment)
        assert timestamp(moment) == expected, moment
