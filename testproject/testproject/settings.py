"""A real Django project for the demo and the tests.

With no ``DLOCK_BACKENDS`` setting, ``django_dlock`` uses its zero-config
default: the database backend on the "default" database, here SQLite.
"""

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "testproject-only-not-a-secret")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost", "testserver"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_dlock",
    "demo",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "testproject.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "testproject.wsgi.application"

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ.get("DLOCK_DEMO_DB", str(BASE_DIR / "db.sqlite3")),
        # Several demo processes write at once; wait for SQLite's write lock.
        "OPTIONS": {"timeout": 20},
    }
}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"

# Celery (testproject/celery.py). The default broker is kombu's filesystem
# transport and results go to files, so the demo's worker needs no server;
# the tests set CELERY_BROKER_URL / CELERY_RESULT_BACKEND to real ones.
CELERY_DATA_DIR = Path(os.environ.get("DLOCK_CELERY_DATA", BASE_DIR / ".celery"))
CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", "filesystem://")
CELERY_BROKER_TRANSPORT_OPTIONS = (
    {
        "data_folder_in": str(CELERY_DATA_DIR / "queue"),
        "data_folder_out": str(CELERY_DATA_DIR / "queue"),
        # Without it kombu writes its broadcast exchanges to ./control.
        "control_folder": str(CELERY_DATA_DIR / "control"),
        "polling_interval": 0.1,
    }
    if CELERY_BROKER_URL == "filesystem://"
    else {}
)
CELERY_RESULT_BACKEND = os.environ.get(
    "CELERY_RESULT_BACKEND", f"file://{CELERY_DATA_DIR / 'results'}"
)
CELERY_TASK_SERIALIZER = CELERY_RESULT_SERIALIZER = "json"
