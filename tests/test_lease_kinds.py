"""One way into a lease (django_dlock.testing) on every backend of CONFORMANCE_BACKENDS."""

from django_dlock.testing.test_lease_kinds import *  # noqa: F403
