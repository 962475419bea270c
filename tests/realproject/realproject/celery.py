"""The Celery app, in the layout of Celery's Django guide."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "realproject.settings")

app = Celery("realproject")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
