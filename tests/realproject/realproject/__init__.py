"""A Django project configured as production ones are, to test django-dlock under load."""

from .celery import app as celery_app

__all__ = ["celery_app"]
