"""The ASGI application uvicorn serves for benchmarks/async_handover.py --views."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmarks.async_views_settings")
application = get_asgi_application()
