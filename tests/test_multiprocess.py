"""Locks across real processes (django_dlock.testing) on every backend of CONFORMANCE_BACKENDS."""

from django_dlock.testing.test_multiprocess import *  # noqa: F403
