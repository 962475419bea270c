"""The etcd v3 backend: session leases, a revision-ordered queue, fencing by revision.

Settings::

    "BACKEND": "django_dlock.backends.etcd.EtcdBackend",
    "LOCATION": ["10.0.0.1:2379", "10.0.0.2:2379", "10.0.0.3:2379"],
    "OPTIONS": {"ca": "/etc/etcd/ca.crt", "user": "app", "password": "..."},

``LOCATION`` is one endpoint or a list of them (``host:port``, ``http://host:port``
or ``https://host:port``); a request that fails on one member is sent to the
next. ``OPTIONS``: ``ca``, ``cert``, ``key`` (TLS files: the CA to trust, and a
client certificate and key), ``user`` and ``password`` (etcd authentication),
``timeout`` (seconds one operation may take, failover included; default 5).

The algorithm is etcd's own ``concurrency.Mutex``, the python-etcd recipe of
watching the predecessor, and ``contrib/lock``'s fencing by revision. For
``KEY_PREFIX`` P, lock name N (``%`` and ``/`` escaped as ``%25`` and ``%2F``)
and lease L in hex::

    Pdlock/N/L    value: holder JSON; attached to lease L

- **Session lease.** A process keeps one lease per backend and TTL (whole
  seconds, rounded up), kept alive by the watchdog while it holds locks and by
  the waiting thread while it waits, and revoked by ``close()`` and at exit.
  When one process waits for, or holds, the same name from several threads
  at once, each needs its own key, so it uses a second lease of that TTL (a
  third, ...). ``renew=False`` gets a lease of its own, revoked on release, so
  that it runs out after its TTL whatever the process's other locks do.
- **Acquire** is one transaction: put ``Pdlock/N/L`` if its create revision is
  0, and in the same transaction read the two newest keys under ``Pdlock/N/``
  by create revision. Inside the transaction ours is the newest, so the other
  is the key just ahead of ours; if there is none, ours has the lowest create
  revision: we hold the lock, and the **fencing token** is our key's create
  revision plus the epoch read in the same transaction (``epochs.py``: tokens
  do not repeat after etcd loses its data).
- **Waiting** watches the key just below ours for its delete (from the
  revision at which we saw it, so a delete in between is not missed), then
  re-checks in one transaction (is our key still there, and is any key older
  than it left?): the key ahead may have been a waiter that gave up.
  Waiters are therefore served strictly in arrival order.
- **Release** deletes our key if its create revision is still ours.
  A waiter that times out deletes its key; one that dies leaves it to expire
  with its lease.
- **List** is a range over the prefix; the holder of each name is its key with
  the lowest create revision. **Break** deletes that key, which wakes the
  next waiter.

So ``etcdctl lock Pdlock/N`` and this backend exclude each other, and
``etcdctl get --prefix Pdlock/`` shows holders and waiters.

Semaphores and read/write locks are the same queue with weights, under
``Pdlock-slots/``, and parked Celery calls live under ``Pdlock-parked/``
(``slots.py`` says how).
"""

# The stubs in etcdrpc/ are this package's own; what they need is grpcio and
# protobuf, the etcd extra. (A grpcio or protobuf older than the extra's floor
# fails in the stubs, with a message that names the version they need.)
try:
    import google.protobuf  # noqa: F401
    import grpc  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "The etcd lock backend needs grpcio and protobuf: pip install 'django-dlock[etcd]'"
    ) from e

from .backend import EtcdBackend

# The public API is the backend named in DLOCK_BACKENDS (__all__, docs/api.rst).
# The transport's constants stay importable here, but are the implementation's.
from .transport import ATTEMPT_SHARE as ATTEMPT_SHARE
from .transport import REFUSED_CODES as REFUSED_CODES
from .transport import RETRY_CODES as RETRY_CODES
from .transport import RETRY_PAUSE as RETRY_PAUSE
from .transport import TRANSIENT_CODES as TRANSIENT_CODES

__all__ = ["EtcdBackend"]
