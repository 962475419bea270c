"""The semaphores' model-based tests (django_dlock.testing) on every backend under test."""

from django_dlock.testing.test_model_slots import *  # noqa: F403
