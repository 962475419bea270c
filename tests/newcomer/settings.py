"""A newcomer's settings: Django's defaults plus the app, and nothing of ours configured.

No DLOCK_BACKENDS, so locks use the database backend on "default", which
Django's test runner turns into an in-memory SQLite database, and tests run
inside a transaction (TestCase, or pytest-django's ``django_db`` mark).
"""

SECRET_KEY = "newcomer-tests-only"
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django_dlock",
]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": "newcomer.sqlite3"}}
USE_TZ = True
