"""The conformance suite (django_dlock.testing) on every backend of CONFORMANCE_BACKENDS."""

from django_dlock.testing.test_conformance import *  # noqa: F403
from django_dlock.testing.test_waiting import *  # noqa: F403
