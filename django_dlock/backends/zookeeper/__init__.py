"""The ZooKeeper backend: the lock recipe on ephemeral sequential nodes, fenced by ``czxid``.

Settings::

    "BACKEND": "django_dlock.backends.zookeeper.ZooKeeperBackend",
    "LOCATION": "zk://10.0.0.1:2181,10.0.0.2:2181,10.0.0.3:2181/myapp",
    "OPTIONS": {"session_timeout": 10, "auth": [("digest", "app:secret")]},

``LOCATION`` is ``host:port`` (or a list of them, or a comma-separated string),
or a ``zk://host:port,host:port/chroot`` URL. ``OPTIONS``: ``chroot`` (a path
every node lives under; also the URL's path), ``session_timeout`` (seconds,
default 10), ``timeout`` (seconds to connect and for one operation, default
5), ``auth`` (a list of ``(scheme, credential)`` pairs, as kazoo's
``auth_data``).

The algorithm is the ZooKeeper lock recipe, as kazoo's ``Lock`` and Curator's
``InterProcessMutex`` run it. For ``KEY_PREFIX`` P and lock name N (percent-
escaped, so that any name is one path component and a prefix of a name stays a
prefix of its path)::

    /Pdlock/N/<owner>__lock__0000000042    data: holder JSON; ephemeral, sequential

- **Acquire** creates our node and, pipelined behind it on the same session,
  reads the children of ``/Pdlock/N``: the contender with the lowest sequence
  number holds the lock. That is one round trip, as the raw create is.
- **Waiting** watches only the contender just ahead of ours (no herd); when it
  goes, the children are read again (the one ahead may have been a waiter
  that gave up). Waiters are served in the order they created their nodes.
- **Fencing token**: our node's ``czxid``, the zxid of the transaction that
  created it, which ZooKeeper makes strictly increasing across the whole
  ensemble, its leader elections and restarts. A lease adopted from a ticket
  keeps the token it had (stored in its node's data).
- **The lease is the session.** A node lives as long as the session that
  created it: a holder that dies, freezes or is cut off loses its locks when
  its session expires, ``session_timeout`` after the server last heard from
  it. While the process lives, a lease also ends at its TTL unless renewed:
  the process deletes its node then. A handle never counts on more than the
  session timeout since the service last answered it (``drift``), so a
  holder frozen past its session cannot believe it still holds the lock.
  ``extend(ttl)`` and the watchdog's renewals rewrite the node's data (owner-
  checked: the node must still exist), which both confirms the session and
  records the new TTL for listing.
- **Release** deletes our node, which wakes the next waiter's watch. An empty
  lock directory is deleted later, off the acquire path.
- **List** reads the children of ``/Pdlock`` (one call), keeps the names with
  the prefix, and reads each one's contenders and its holder's node.
- **Break** deletes the holder's node (with ``token``: only the node of that
  token).

Nodes named ``…__lock__<sequence>`` are what kazoo's ``Lock`` creates and
reads, so kazoo's ``Lock(client, "/Pdlock/N")`` and this backend exclude each
other. Curator's ``InterProcessMutex`` names its nodes ``…-lock-<sequence>``:
this backend counts those as contenders too (a Curator holder excludes ours),
but Curator does not count ours.

Semaphores, read/write locks and parked Celery calls are not implemented on
ZooKeeper (``supports_semaphores``/``supports_parking`` are False).
"""

try:
    import kazoo  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "The ZooKeeper lock backend needs kazoo: pip install 'django-dlock[zookeeper]'"
    ) from e

from .backend import ZooKeeperBackend

__all__ = ["ZooKeeperBackend"]
