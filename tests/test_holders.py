"""What manage.py locks and the admin share: JSON of a lease, holders parsed in bulk."""

from __future__ import annotations

import json
import math
import os
from datetime import datetime, timedelta, timezone

import pytest

from django_dlock._validation import holder_metadata, load_holder, load_holders, printable
from django_dlock.backends.base import LockInfo
from django_dlock.holders import duration, holder_label
from django_dlock.management.formatting import as_json

NOW = datetime(2026, 11, 21, 12, 0, 0, tzinfo=timezone.utc)


def info(holder_json: str | None, holder: dict[str, object], expires_in: float) -> LockInfo:
    acquired = NOW - timedelta(seconds=2.5)
    expires = NOW + timedelta(seconds=expires_in) if math.isfinite(expires_in) else NOW
    return LockInfo(
        "default", 'a "quoted" \x1b name', 7, holder, acquired, expires, expires_in, holder_json
    )


@pytest.mark.parametrize(
    ("holder_json", "holder"),
    [
        ('{"host":"vm","pid":1}', {"host": "vm", "pid": 1}),
        (None, {"host": "vm", "note": "from a backend that keeps no text"}),
        ('{"note":"caf\u00e9 \u009b"}', {"note": "caf\u00e9 \u009b"}),  # not ASCII: re-encoded
    ],
)
def test_as_json_is_the_lease_as_a_json_object(
    holder_json: str | None, holder: dict[str, object]
) -> None:
    text = as_json(info(holder_json, holder, 27.5), NOW)
    assert text.isascii()  # nothing a terminal would act on
    assert json.loads(text) == {
        "backend": "default",
        "name": 'a "quoted" \x1b name',
        "token": 7,
        "holder": holder,
        "acquired_at": "2026-11-21T11:59:57.500000+00:00",
        "expires_at": "2026-11-21T12:00:27.500000+00:00",
        "expires_in": 27.5,
        "held_for": 2.5,
        "kind": "mutex",
    }


def test_as_json_of_a_lease_with_no_end() -> None:
    item = json.loads(as_json(info(None, {}, math.inf), NOW))
    assert item["expires_at"] is None and item["expires_in"] is None


@pytest.mark.parametrize(
    "texts",
    [
        ['{"a":1}', '{"b":[1,2]}', "{}"],
        ['{"a":1}', "not json", '{"b":2}'],
        ['{"a":1}', "", '{"b":2}'],
        ['{"a":1},{"c":3}', '{"b":2}'],
        ["1", '{"b":2}'],
        ["[1]", '{"b":2}'],
    ],
    ids=["all-json", "garbage", "empty", "two-objects", "number", "list"],
)
def test_load_holders_matches_load_holder_one_by_one(texts: list[str]) -> None:
    holders, faithful = load_holders(texts)
    assert holders == [load_holder(text) for text in texts]
    # Only when each text is exactly its holder's JSON may it be copied as is.
    assert faithful == (texts == ['{"a":1}', '{"b":[1,2]}', "{}"])


def test_labels_durations_and_printable() -> None:
    assert holder_label({"host": "vm", "pid": 3}) == "vm:3"
    task = {"host": "vm", "pid": 3, "task_name": "t.sync", "task_id": "abc"}
    assert holder_label(task) == "vm:3 t.sync[abc]"
    assert [duration(s) for s in (4.21, 185, 7260, 273600, math.inf)] == [
        "4.2s",
        "3m05s",
        "2h01m",
        "3d04h",
        "never",
    ]
    assert printable("ok:name") == "ok:name"
    assert printable("a\x1b[2J\nb\u200b") == "a\\x1b[2J\\nb\\u200b"


def test_holder_metadata_is_its_json_and_says_when() -> None:
    before = datetime.now(timezone.utc)
    holder, text = holder_metadata(30, None)
    after = datetime.now(timezone.utc)
    assert json.loads(text) == holder
    acquired_at = datetime.fromisoformat(holder["acquired_at"])
    # Written to the millisecond, which is cut (not rounded) as isoformat() does.
    assert before.replace(microsecond=before.microsecond // 1000 * 1000) <= acquired_at <= after
    assert holder["acquired_at"].endswith("+00:00")
    assert (holder["pid"], holder["ttl"]) == (os.getpid(), 30.0)
