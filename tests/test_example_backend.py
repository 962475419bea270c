"""The example backend of docs/development.md beyond the conformance suite."""

from __future__ import annotations

from pathlib import Path

from tests.example_backend import SQLiteFileBackend


def test_tokens_keep_growing_after_the_file_is_lost(tmp_path: Path) -> None:
    """A lost file (a restart that lost its data) must not reissue a token."""
    path = tmp_path / "locks.sqlite3"
    before = SQLiteFileBackend("example-lost", {"LOCATION": str(path)})
    first = before.acquire("x", renew=False)
    first.release()
    second = before.acquire("x", renew=False)
    second.release()
    before.close()
    path.unlink()
    after = SQLiteFileBackend("example-lost", {"LOCATION": str(path)})
    third = after.acquire("x", renew=False)
    third.release()
    after.close()
    assert first.token < second.token < third.token
