"""The async API (django_dlock.testing) on every backend of CONFORMANCE_BACKENDS."""

from django_dlock.testing.test_async import *  # noqa: F403
