"""A project as a newcomer configures one on PostgreSQL; the test sets the rest by environment.

DLOCK_PGTP_DB: the database's name (its test database is "test_" + it);
DLOCK_PGTP_ATOMIC_REQUESTS and DLOCK_PGTP_CONN_MAX_AGE: as in DATABASES.
"""

import os

SECRET_KEY = "pgtestproject-not-secret"
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]
USE_TZ = True
INSTALLED_APPS = ["django_dlock", "pgapp"]
MIDDLEWARE: list[str] = []
ROOT_URLCONF = "pgtestproject.urls"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ["DLOCK_PGTP_DB"],
        "HOST": os.environ.get("DLOCK_TEST_PG_HOST", "127.0.0.1"),
        "PORT": int(os.environ.get("DLOCK_TEST_PG_PORT", "5432")),
        "USER": os.environ.get("DLOCK_TEST_PG_USER", "postgres"),
        "PASSWORD": os.environ.get("DLOCK_TEST_PG_PASSWORD", ""),
        "ATOMIC_REQUESTS": os.environ.get("DLOCK_PGTP_ATOMIC_REQUESTS") == "1",
        "CONN_MAX_AGE": int(os.environ.get("DLOCK_PGTP_CONN_MAX_AGE", "0")),
    },
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
# No DLOCK_BACKENDS: the default, the database backend on "default".
