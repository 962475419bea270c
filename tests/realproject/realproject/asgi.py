"""ASGI entry point: ``uvicorn realproject.asgi:application`` serves sync and async views."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "realproject.settings")

application = get_asgi_application()
