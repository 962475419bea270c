"""The conformance suite of django-dlock's backend contract, for any backend.

A backend written outside django-dlock runs every backend-generic test of
django-dlock's own (mutex, semaphores, watchdog, async, multi-process,
model-based) with one command, as tooz's suite runs from ``TOOZ_TEST_URL``::

    pip install "django-dlock[testing]"
    python -m django_dlock.testing --backend mypackage.backends.MyBackend \
        --location "..." --options '{"key": "value"}'

``--backend``, ``--location`` (a string, or JSON for a list) and ``--options``
(JSON) are the backend's ``DLOCK_BACKENDS`` entry; ``DLOCK_TEST_BACKEND``,
``DLOCK_TEST_LOCATION`` and ``DLOCK_TEST_OPTIONS`` in the environment say the
same. Any other argument goes to pytest (``-x``, ``-k``, ``-n 2`` with
pytest-xdist). It configures Django (``settings.py`` here: a SQLite
database in a temporary directory, the backend under the alias
``"under_test"``) and runs the ``test_*.py`` modules of this package.

What a backend declares it cannot do (``supports_semaphores``,
``supports_multiprocess``, ``supports_fair``, ...) is skipped, with that
reason in the summary; so are the few tests of django-dlock's own backends.

Importing this package imports nothing more; its modules need pytest,
pytest-django and Hypothesis (the ``testing`` extra). ``plugin.py`` is the
pytest plugin the suites need, for a project that runs them by its own pytest.
"""

# The command is the public face; the modules are the suite it runs.
__all__: list[str] = []
