"""Locked Celery tasks for ``manage.py dlock_demo``'s fourth act."""

from __future__ import annotations

import os
import time
from typing import Any

from django_dlock.celery import locked_task


@locked_task(key="report:{account_id}", ttl=30, bind=True)
def build_report(self: Any, account_id: int, seconds: float = 2.0) -> dict[str, Any]:
    """Run scope: a duplicate that arrives while one runs is skipped (returns None)."""
    time.sleep(seconds)
    return {"account_id": account_id, "token": self.lock.token, "pid": os.getpid()}


@locked_task(key="sync:{account_id}", ttl=30, scope="queue", bind=True)
def sync_account(self: Any, account_id: int, seconds: float = 2.0) -> dict[str, Any]:
    """Queue scope: a duplicate is not even enqueued while one is queued or running.

    It runs for ``seconds`` so that the demo's burst of duplicate calls all
    arrive while the first is queued or running: a body that returned at
    once could let a later duplicate through, rightly, once it had finished.
    """
    time.sleep(seconds)
    return {"account_id": account_id, "token": self.lock.token, "pid": os.getpid()}
