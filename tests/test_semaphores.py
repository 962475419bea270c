"""Semaphores and read/write locks (django_dlock.testing) on every backend under test."""

from django_dlock.testing.test_semaphores import *  # noqa: F403
