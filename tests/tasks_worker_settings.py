"""Settings of the ``db_worker`` processes that tests/test_django_tasks.py starts.

The test settings, on the test database of the session that started them:
its SQLite file (DLOCK_TEST_TMP is inherited), where the enqueued tasks and
the "db-sqlite" leases are.
"""

from tests.settings import *  # noqa: F403
from tests.settings import DATABASES

DATABASES["default"]["NAME"] = DATABASES["default"]["TEST"]["NAME"]
