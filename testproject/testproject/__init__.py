# Load the Celery app with Django, so that @shared_task (and @locked_task) use it.
from .celery import app as celery_app

__all__ = ["celery_app"]
