"""The public API's contract: argument checking, the Lock object, decorators, async."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest

import django_dlock
from django_dlock import HeldLock, Lock, LockTimeout, lock, locks

pytestmark = pytest.mark.backends("locmem")


def test_public_names() -> None:
    from django_dlock import DLockError, LockLost, LockTimeout, lock, locks  # noqa: F401

    for name in django_dlock.__all__:
        assert hasattr(django_dlock, name), name


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"ttl": 0}, ValueError, "ttl"),
        ({"ttl": -5}, ValueError, "ttl"),
        ({"ttl": float("nan")}, ValueError, "ttl"),
        ({"ttl": float("inf")}, ValueError, "leases always expire"),
        ({"ttl": "30"}, TypeError, "ttl"),
        ({"ttl": True}, TypeError, "ttl"),
        ({"timeout": -1}, ValueError, "timeout"),
        ({"timeout": "5"}, TypeError, "timeout"),
        ({"backend": 3}, TypeError, "backend"),
        ({"metadata": {"when": object()}}, TypeError, "JSON"),
        ({"metadata": ["not", "a", "dict"]}, TypeError, "metadata"),
    ],
)
def test_bad_arguments_are_refused_up_front(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        lock("x", **kwargs)


@pytest.mark.parametrize(
    ("bad", "error"), [("", ValueError), (None, TypeError), (b"x", TypeError)]
)
def test_bad_names(bad: Any, error: type[Exception]) -> None:
    with pytest.raises(error):
        lock(bad)
    with pytest.raises(error):
        locks["locmem"].break_lock(bad)


def test_infinite_timeout_means_wait_forever() -> None:
    assert lock("x", timeout=float("inf")).timeout is None


def test_acquire_by_hand_and_release_through_the_lock(backend_alias: str, name: str) -> None:
    the_lock = lock(name, backend=backend_alias)
    held = the_lock.acquire()
    assert isinstance(held, HeldLock)
    the_lock.release()
    assert held.released
    with pytest.raises(RuntimeError, match="not acquired"):
        the_lock.release()


def test_acquire_timeout_overrides(backend_alias: str, name: str) -> None:
    with lock(name, backend=backend_alias):
        with pytest.raises(LockTimeout):
            lock(name, backend=backend_alias, timeout=None).acquire(timeout=0)


def test_one_lock_object_shared_by_threads(backend_alias: str, name: str) -> None:
    shared = lock(name, backend=backend_alias, timeout=30)
    tokens: list[int] = []
    guard = threading.Lock()

    def worker() -> None:
        for _ in range(10):
            with shared as held:
                with guard:
                    tokens.append(held.token)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(set(tokens)) == 30


def test_held_lock_is_a_context_manager(backend_alias: str, name: str) -> None:
    with lock(name, backend=backend_alias).acquire() as held:
        assert not held.released
    assert held.released


def test_held_lock_cannot_be_built_by_hand() -> None:
    with pytest.raises(TypeError):
        HeldLock()


def test_decorator_template_must_name_parameters() -> None:
    with pytest.raises(ValueError, match="account_id"):

        @lock("sync:{account_id}")
        def sync(user_id: int) -> None: ...

    with pytest.raises(ValueError, match="name arguments"):

        @lock("sync:{}")
        def sync2(user_id: int) -> None: ...


def test_decorator_uses_defaults_attributes_and_kwargs(backend_alias: str, name: str) -> None:
    keys: list[str] = []

    class Invoice:
        pk = 42

    @lock(name + ":{invoice.pk}:{mode}:{extra}", backend=backend_alias)
    def regenerate(invoice: Invoice, mode: str = "full", **kwargs: Any) -> None:
        keys.extend(i.name for i in locks[backend_alias].list(name))

    regenerate(Invoice(), extra="yes")
    assert keys == [f"{name}:42:full:yes"]


def test_decorator_literal_braces(backend_alias: str, name: str) -> None:
    keys: list[str] = []

    @lock(name + ":{{literal}}", backend=backend_alias)
    def job() -> None:
        keys.extend(i.name for i in locks[backend_alias].list(name))

    job()
    assert keys == [f"{name}:{{literal}}"]


def test_decorated_function_releases_on_exception(backend_alias: str, name: str) -> None:
    @lock(name, backend=backend_alias)
    def fails() -> None:
        raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        fails()
    assert locks[backend_alias].list(name) == []


def test_async_with(backend_alias: str, name: str) -> None:
    async def main() -> tuple[int, list[str]]:
        async with lock(name, backend=backend_alias) as held:
            listed = [i.name for i in locks[backend_alias].list(name)]
            return held.token, listed

    token, listed = asyncio.run(main())
    assert listed == [name]
    assert locks[backend_alias].list(name) == []
    assert token > 0


def test_async_tasks_each_get_their_own_handle(backend_alias: str, name: str) -> None:
    shared = lock(name, backend=backend_alias, timeout=30)
    order: list[tuple[str, int]] = []

    async def task(label: str) -> None:
        async with shared as held:
            order.append((label, held.token))
            await asyncio.sleep(0.05)

    async def main() -> None:
        await asyncio.gather(task("a"), task("b"), task("c"))

    asyncio.run(main())
    tokens = [t for _, t in order]
    assert sorted({label for label, _ in order}) == ["a", "b", "c"]
    assert tokens == sorted(tokens) and len(set(tokens)) == 3


def test_async_decorator(backend_alias: str, name: str) -> None:
    @lock(name + ":{n}", backend=backend_alias, timeout=0)
    async def work(n: int) -> list[str]:
        return [i.name for i in locks[backend_alias].list(name)]

    assert asyncio.run(work(1)) == [f"{name}:1"]
    assert locks[backend_alias].list(name) == []


def test_lock_repr_and_backend_shortcut(backend_alias: str, name: str) -> None:
    via_backend = lock(name, backend=backend_alias, ttl=5)
    assert isinstance(via_backend, Lock)
    assert via_backend.backend == backend_alias
    with via_backend as held:
        assert name in repr(held)
        assert str(held.token) in repr(held)


@pytest.mark.parametrize(
    "thread_name", ["MainThread", 'quote"and\\back', "ünï\u2028code", "a" * 300]
)
def test_fast_holder_json_matches_the_encoder(thread_name: str) -> None:
    from django_dlock._validation import dump_holder, holder_metadata

    seen: list[tuple[Any, Any, str]] = []

    def build() -> None:
        holder, text = holder_metadata(12.5, None)
        fast = json.loads(text)
        seen.append((fast, json.loads(dump_holder(holder)), fast["thread"]))

    thread = threading.Thread(target=build, name=thread_name)
    thread.start()
    thread.join()
    [(fast, reference, name)] = seen
    assert fast == reference
    assert name == thread_name


def test_owner_tokens_are_unique() -> None:
    from django_dlock._validation import new_owner

    owners = {new_owner() for _ in range(10_000)}
    assert len(owners) == 10_000
    assert all(len(o) == 32 for o in owners)


def test_a_long_lived_lock_keeps_no_released_handles() -> None:
    """``h = lk.acquire(); h.release()`` in a loop kept every handle (issue 15)."""
    import gc
    import weakref

    lk = lock("api:long-lived", backend="locmem")
    refs = []
    for _ in range(500):
        h = lk.acquire()
        h.release()
        refs.append(weakref.ref(h))
    lk.acquire().release()
    del h
    gc.collect()
    assert sum(ref() is not None for ref in refs) == 0
    with lk as held:  # the object still works as a context manager
        assert held.token > 0


def test_the_factories_take_what_their_classes_take() -> None:
    """``lock()``, ``semaphore()`` and ``rwlock()`` spell out their class's arguments."""
    import inspect

    from django_dlock import RWLock, Semaphore, rwlock, semaphore

    def params(f: Any) -> list[tuple[str, Any, Any]]:
        found = inspect.signature(f).parameters.values()
        return [(p.name, p.kind, p.default) for p in found if p.name != "self"]

    assert params(lock) == params(Lock.__init__)
    assert params(rwlock) == params(RWLock.__init__)
    lock_params = [p for p in params(Lock.__init__) if p[0] not in ("release_on_commit", "using")]
    kw_only = inspect.Parameter.KEYWORD_ONLY
    assert params(semaphore) == [
        lock_params[0],
        ("limit", kw_only, inspect.Parameter.empty),
        *lock_params[1:],
    ]
    assert isinstance(semaphore("x", limit=2), Semaphore)
