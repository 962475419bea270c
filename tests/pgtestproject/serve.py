"""Serve the project on a fixed pool of threads, as gunicorn's gthread worker does.

Prints the port, then serves until killed. Each request ends as under any
WSGI server: the response is closed, and Django's request_finished closes
the thread's connections that CONN_MAX_AGE says to close.
"""

import os
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import django
from django.core.wsgi import get_wsgi_application


class PoolServer(WSGIServer):
    pool = ThreadPoolExecutor(8)
    request_queue_size = 64

    def process_request(self, request: Any, client_address: Any) -> None:
        self.pool.submit(self._handle, request, client_address)

    def _handle(self, request: socket.socket, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)


class QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "pgtestproject.settings")
    django.setup()
    server = make_server(
        "127.0.0.1", 0, get_wsgi_application(), server_class=PoolServer, handler_class=QuietHandler
    )
    print(server.server_port, flush=True)
    server.serve_forever()
