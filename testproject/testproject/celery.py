"""The test project's Celery app, in the layout Celery's Django guide uses.

``celery -A testproject worker`` finds ``app`` here; it reads the ``CELERY_*``
Django settings and finds each installed app's ``tasks`` module.
"""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")

app = Celery("testproject")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
