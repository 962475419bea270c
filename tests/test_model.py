"""The model-based tests (django_dlock.testing) on every backend of CONFORMANCE_BACKENDS.

``make model-long`` runs them with Hypothesis's "long" profile.
"""

from django_dlock.testing.test_model import *  # noqa: F403
