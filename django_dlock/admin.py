"""The admin's "Locks" page: live leases on every backend, and a guarded "Break".

There is no table behind it (``models.LockListing`` is unmanaged): the views list
from the backends through :mod:`django_dlock.holders`, like
``manage.py locks``. Viewing needs ``django_dlock.view_lock``; breaking needs
``django_dlock.view_lock`` and ``django_dlock.break_lock`` (the confirmation
page shows the holder's metadata, which is what viewing means), a POST with a
CSRF token, and a second POST from the confirmation page. Each break is
written to the admin log and sends ``lock_broken``.

Each backend is listed on a thread of its own, and the page waits at most
``LockAdmin.listing_timeout`` seconds for them: a server that accepts
connections and never answers is named on the page as not answering, and the
others are listed (:func:`bounded_listing`). A backend whose settings are bad
is named with its error.

The forms carry a lock's name as a *lock id*, the base64url of its UTF-8
(:func:`lock_id`), never as text: a browser posts a hidden field's line
breaks as CRLF, so a name with an LF or a CR would come back as another name.

Mutexes' leases come first, one row each; then the semaphores and read/write
locks, one row per holder's slot, in a table of their own (same paging). A
break of a slot names its fencing token, so it frees that holder's slot and
no other: the break form says ``kind`` ("semaphore" or "rwlock").

:class:`LockedModelAdmin` (or :class:`LockedModelAdminMixin`) is for the
admins of ``LockedSaveMixin`` models: a save or delete that finds the
instance's lock held is refused with a message, not a server error.
"""

from __future__ import annotations

import base64
import binascii
import re
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from datetime import datetime
from functools import partial
from typing import Any
from urllib.parse import parse_qsl, urlencode

import django
from django.contrib import admin, messages
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.views.decorators.http import require_POST

from . import holders
from .backends.base import BaseLockBackend, LockInfo
from .exceptions import DLockError, LockTimeout
from .handler import locks
from .models import LockListing
from .pings import UnderWay, on_daemon_thread

__all__ = ["LockedModelAdmin", "LockedModelAdminMixin"]

#: Leases per page.
PER_PAGE = 100
#: Seconds between reloads of the list unless ``?refresh=`` says otherwise (0: off).
REFRESH = 10
REFRESH_CHOICES = (0, 5, 10, 30, 60)
#: The sidebar's "By kind" filter: ``?kind=`` value -> label.
KINDS = {"mutex": "Locks", "semaphore": "Semaphores", "rwlock": "Read/write locks"}
#: The ``kind`` of a break form that frees a slot rather than a mutex's lease.
SLOT_KINDS = ("semaphore", "rwlock")
#: Seconds the Locks pages wait for the backends to answer (``LockAdmin.listing_timeout``).
LISTING_TIMEOUT = 5.0


def _layout() -> dict[str, bool]:
    """The admin markup our pages copy, which Django 6.1 changed.

    From 6.1 the breadcrumbs are an ``<ol>`` and a change list's filter sits
    first inside ``.changelist-form-container`` (a flex box that puts it on
    the right); before, a ``<div>`` and a sibling of the container. Markup of
    the other version breaks the page's layout (its CSS styles only its own).
    """
    return {"admin_61_layout": django.VERSION >= (6, 1)}


@admin.register(LockListing)
class LockAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    #: Seconds the pages wait for the backends' answers (all at once, each on a thread).
    listing_timeout = LISTING_TIMEOUT
    holders_template = "admin/django_dlock/locklisting/holders.html"
    confirmation_template = "admin/django_dlock/locklisting/break_confirmation.html"

    # Nothing is added, changed or deleted here; viewing is the view_lock
    # permission, which ModelAdmin's default check (view_<model name>, here
    # view_locklisting) would not find.
    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return request.user.has_perm(f"{self.opts.app_label}.view_lock")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_break_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(f"{self.opts.app_label}.break_lock")

    def get_urls(self) -> list[URLPattern]:
        changelist = self.admin_site.admin_view(self.changelist_view)
        break_ = self.admin_site.admin_view(require_POST(self.break_view))
        prefix = f"{self.opts.app_label}_{self.opts.model_name}"
        return [
            path("", changelist, name=f"{prefix}_changelist"),
            path("break/", break_, name=f"{prefix}_break"),
        ]

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        aliases = list(locks)
        backend = request.GET.get("backend") or None
        if backend is not None and backend not in aliases:
            backend = None
        kind = request.GET.get("kind") or None
        if kind not in KINDS:
            kind = None
        query = request.GET.get("q", "").strip()
        refresh = _refresh(request.GET.get("refresh"))
        listing, errors = bounded_listing(
            holders.aliases(backend), holders.current_holders, self.listing_timeout
        )
        found: list[LockInfo | holders.Slot] = []
        if kind in (None, "mutex"):
            found += listing.holders
        if kind != "mutex":
            found += [slot for slot in listing.slots if kind in (None, slot.semaphore.kind)]
        if query:
            needle = query.casefold()
            found = [row for row in found if needle in _name(row).casefold()]
        paginator = Paginator(found, PER_PAGE)
        page = paginator.get_page(request.GET.get("p"))
        now = listing.taken_at
        params = {"backend": backend or "", "kind": kind or "", "q": query, "refresh": refresh}

        def url(**changes: Any) -> str:
            merged = {**params, **changes}
            return "?" + urlencode({k: v for k, v in merged.items() if v not in ("", None)})

        context = {
            **self.admin_site.each_context(request),
            **_layout(),
            "opts": self.opts,
            "title": "Locks",
            "subtitle": None,
            "rows": [_row(row, now) for row in page.object_list if isinstance(row, LockInfo)],
            "slot_rows": [
                _slot_row(row, now) for row in page.object_list if isinstance(row, holders.Slot)
            ],
            "page": page,
            "page_links": [
                (number, url(p=number)) for number in paginator.get_elided_page_range(page.number)
            ],
            "total": paginator.count,
            "lock_total": sum(isinstance(row, LockInfo) for row in found),
            "slot_total": sum(
                isinstance(row, holders.Slot) and row.lease is not None for row in found
            ),
            "backends": [
                (alias, alias == backend, url(backend=alias, p=None)) for alias in aliases
            ],
            "all_backends_url": url(backend=None, p=None),
            "backend": backend,
            "kinds": [
                (label, value == kind, url(kind=value, p=None)) for value, label in KINDS.items()
            ],
            "all_kinds_url": url(kind=None, p=None),
            "kind": kind,
            "query": query,
            "errors": errors,
            "refresh": refresh,
            "refresh_choices": [
                (seconds, seconds == refresh, url(refresh=seconds)) for seconds in REFRESH_CHOICES
            ],
            "taken_at": now,
            "columns": [column.capitalize() for column in holders.COLUMNS],
            "slot_columns": [column.capitalize() for column in holders.SLOT_COLUMNS],
            "can_break": self.has_break_permission(request),
            "filters": url()[1:],
            **(extra_context or {}),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, self.holders_template, context)

    def break_view(self, request: HttpRequest) -> HttpResponse:
        """POST backend, name, token (and kind, for a slot): the confirmation page;
        with ``confirm``: the break."""
        if not (self.has_view_permission(request) and self.has_break_permission(request)):
            raise PermissionDenied
        changelist = reverse(
            f"{self.admin_site.name}:{self.opts.app_label}_{self.opts.model_name}_changelist"
        ) + _list_query(request.POST.get("filters", ""))
        alias = request.POST.get("backend", "")
        posted_id = request.POST.get("lock", "")
        try:
            token = int(request.POST.get("token", ""))
        except ValueError:
            token = None
        if alias not in list(locks) or not posted_id or token is None:
            messages.error(request, "That break request did not name a lock and its token.")
            return HttpResponseRedirect(changelist)
        name = name_of_lock_id(posted_id)
        if name is None:
            messages.error(
                request,
                f"{posted_id[:100]!r} is not a lock id this page wrote: nothing was broken.",
            )
            return HttpResponseRedirect(changelist)
        is_slot = request.POST.get("kind") in SLOT_KINDS
        listing, errors = bounded_listing(
            [alias],
            lambda alias: holders.find_holders(name, alias, slots=is_slot),
            self.listing_timeout,
        )
        if errors:
            messages.error(request, f"{errors[0]} So nothing was broken.")
            return HttpResponseRedirect(changelist)
        current: LockInfo | holders.Slot | None
        if is_slot:
            current = next(
                (s for s in listing.slots if s.lease is not None and s.lease.token == token), None
            )
            gone = "has been released or has expired since it was listed"
            what = f"the slot of {name!r} with token {token} on {alias}"
        else:
            current = next((info for info in listing.holders if info.token == token), None)
            gone = "has been released or taken again since it was listed"
            what = f"the lease on {name!r} with token {token} on {alias}"
        if current is None:
            messages.warning(request, f"Nothing broken: {what} {gone}.")
            return HttpResponseRedirect(changelist)
        if request.POST.get("confirm") != "yes":
            context = {
                **self.admin_site.each_context(request),
                **_layout(),
                "opts": self.opts,
                "title": "Are you sure?",
                "subtitle": None,
                "row": (
                    _slot_row(current, listing.taken_at)
                    if isinstance(current, holders.Slot)
                    else _row(current, listing.taken_at)
                ),
                "changelist_url": changelist,
                "filters": request.POST.get("filters", ""),
            }
            request.current_app = self.admin_site.name
            return TemplateResponse(request, self.confirmation_template, context)
        try:
            if isinstance(current, holders.Slot):
                broken = holders.break_slot(current)
            else:
                broken = holders.break_holder(current)
        except DLockError as e:
            messages.error(request, f"{alias}: {e}")
            return HttpResponseRedirect(changelist)
        if not broken:
            messages.warning(request, f"Nothing broken: {what} ended just before the break.")
            return HttpResponseRedirect(changelist)
        if isinstance(current, holders.Slot):
            done = f"Freed {holders.slot_label(current)} {name!r}"
            holder = current.lease.holder if current.lease is not None else {}
        else:
            done = f"Broke the lease on {name!r}"
            holder = current.holder
        label = holders.holder_label(holder)
        LogEntry.objects.create(
            user_id=request.user.pk,
            content_type_id=ContentType.objects.get_for_model(LockListing).pk,
            object_id=f"{alias}:{name}",
            object_repr=name[:200],
            action_flag=DELETION,
            change_message=(
                f"{done} on backend {alias!r} (fencing token {token}, held by {label})."
            ),
        )
        messages.success(request, f"{done} on {alias} (token {token}, held by {label}).")
        return HttpResponseRedirect(changelist)


#: backend -> when each of its listings under way began (time.monotonic())
_listings = UnderWay()


def bounded_listing(
    aliases: list[str], listing_of: Callable[[str], holders.Listing], timeout: float
) -> tuple[holders.Listing, list[str]]:
    """``listing_of(alias)`` for each alias, merged in their order, within ``timeout``.

    Each runs on a daemon thread and they run at once, so the wait is
    ``timeout`` at most, whatever the backends do; but a backend on Django's
    databases is listed on the request's thread and connection (its own
    timeouts bound it, as they bound the rest of the page). The second value is a
    message per backend that did not answer in time, failed, or could not be
    created from its settings (its own error, which names it). A backend
    whose listing has been under way for longer than ``timeout`` is not
    asked again until it ends: a server that never answers holds the
    threads of one ``timeout``'s requests, not one per page view.
    """
    merged = holders.Listing()
    errors: dict[str, str] = {}
    futures: dict[str, Future[holders.Listing]] = {}
    for alias in aliases:
        try:
            backend = locks[alias]
        except Exception as e:  # bad settings: an ImproperlyConfigured, or the client's own
            errors[alias] = f"Backend {alias} is not configured correctly: {e}"
            continue
        if backend.uses_django_connections:
            # On the request's own connection: another thread's would not see
            # what this one has not committed (a TestCase, ATOMIC_REQUESTS),
            # and the page needs that database anyway.
            inline: Future[holders.Listing] = Future()
            try:
                inline.set_result(listing_of(alias))
            except Exception as e:
                inline.set_exception(e)
            futures[alias] = inline
            continue
        started = _start(backend, partial(listing_of, alias), timeout)
        if isinstance(started, float):
            errors[alias] = (
                f"Backend {alias} has not answered a listing for {started:.1f} s; "
                "it is not asked again until that one ends."
            )
        else:
            futures[alias] = started
    wait_for(futures.values(), timeout)
    for alias, future in futures.items():
        if not future.done():
            errors[alias] = f"Backend {alias} did not answer within {timeout:g} s."
        elif (error := future.exception()) is not None:
            errors[alias] = f"Backend {alias} did not answer: {error}"
        else:
            listing = future.result()
            merged.holders += listing.holders
            merged.slots += listing.slots
            for failed, failure in listing.errors.items():
                errors[failed] = f"Backend {failed} did not answer: {failure}"
    return merged, [errors[alias] for alias in aliases if alias in errors]


def _start(
    backend: BaseLockBackend, call: Callable[[], holders.Listing], timeout: float
) -> Future[holders.Listing] | float:
    """``call()`` on a daemon thread; or, if a listing of ``backend`` has been under way
    for longer than ``timeout``, the seconds it has been (and nothing started)."""
    now = time.monotonic()
    with _listings.mutex:
        began: list[float] = _listings.calls.setdefault(backend, [])
        if began and now - min(began) > timeout:
            return now - min(began)
        began.append(now)

    def done() -> None:
        with _listings.mutex:
            began.remove(now)
            if not began:
                _listings.calls.pop(backend, None)

    return on_daemon_thread(call, f"dlock-admin:{backend.alias}", done)


def lock_id(name: str) -> str:
    """The name as the break forms carry it: base64url of its UTF-8, without padding."""
    encoded = base64.urlsafe_b64encode(name.encode("utf-8", "surrogatepass"))
    return encoded.rstrip(b"=").decode("ascii")


_LOCK_ID = re.compile(r"[A-Za-z0-9_-]+")


def name_of_lock_id(value: str) -> str | None:
    """The name :func:`lock_id` gave ``value`` for; None if it gave no such id."""
    if not _LOCK_ID.fullmatch(value) or len(value) % 4 == 1:
        return None
    try:
        raw = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
        name = raw.decode("utf-8", "surrogatepass")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return name if lock_id(name) == value else None


def _list_query(filters: str) -> str:
    """The list's own parameters from ``filters``, to go back to the page the user was on."""
    kept = [
        (key, value)
        for key, value in parse_qsl(filters)
        if key in ("backend", "kind", "q", "p", "refresh")
    ]
    return f"?{urlencode(kept)}" if kept else ""


def _refresh(value: str | None) -> int:
    try:
        seconds = int(value) if value is not None else REFRESH
    except ValueError:
        return REFRESH
    return seconds if seconds in REFRESH_CHOICES else REFRESH


def _name(row: LockInfo | holders.Slot) -> str:
    return row.semaphore.name if isinstance(row, holders.Slot) else row.name


def _row(info: LockInfo, now: datetime) -> dict[str, Any]:
    cells = holders.columns(info, now)
    return {
        "info": info,
        "lock_id": lock_id(info.name),
        "cells": cells,
        "summary": list(zip(CONFIRM_LABELS, cells, strict=True)),
        "details": [(key, info.holder[key]) for key in info.holder],
        "acquired_at": info.acquired_at,
        "expires_at": None if cells[-1] == "never" else info.expires_at,
    }


#: The labels of a lease's and a slot's cells on the confirmation page.
CONFIRM_LABELS = ("Backend", "Name", "Fencing token", "Holder", "Held for", "Expires in")
SLOT_CONFIRM_LABELS = (
    "Backend",
    "Name",
    "Kind",
    "Limit",
    "Mode",
    "Fencing token",
    "Holder",
    "Held for",
    "Expires in",
    "Waiting",
    "Parked",
)


def _slot_row(slot: holders.Slot, now: datetime) -> dict[str, Any]:
    """A slot as the templates show it; ``info`` is its lease (None: nobody holds one)."""
    cells = holders.slot_columns(slot, now)
    lease = slot.lease
    return {
        "slot": slot,
        "info": lease,
        "lock_id": lock_id(slot.semaphore.name),
        "cells": cells,
        "summary": list(zip(SLOT_CONFIRM_LABELS, cells, strict=True)),
        "kind": "read/write lock" if slot.semaphore.kind == "rwlock" else "semaphore",
        "label": holders.slot_label(slot),
        "details": [] if lease is None else [(key, lease.holder[key]) for key in lease.holder],
        "acquired_at": None if lease is None else lease.acquired_at,
        "expires_at": None if lease is None or cells[8] == "never" else lease.expires_at,
    }


class LockedModelAdminMixin:
    """For a ``ModelAdmin`` of a ``LockedSaveMixin`` model: a held lock is a message, not a 500.

    The change form is shown again with what the user typed and the error
    "... is being changed elsewhere", so that saving again retries; a delete,
    or a list_editable save on the change list, is refused with an error
    message and a redirect to the same page. Nothing is saved or deleted
    (the admin's transaction rolls back).
    """

    def changeform_view(
        self,
        request: HttpRequest,
        object_id: str | None = None,
        form_url: str = "",
        extra_context: dict[str, Any] | None = None,
    ) -> HttpResponse:
        parent = super().changeform_view  # type: ignore[misc]
        try:
            return parent(request, object_id, form_url, extra_context)  # type: ignore[no-any-return]
        except LockTimeout as e:
            # Validate the same POST again, now refused: the form comes back
            # with the user's input and the reason.
            request._dlock_refused = _refusal(e, "saved")  # type: ignore[attr-defined]
            return parent(request, object_id, form_url, extra_context)  # type: ignore[no-any-return]

    def get_form(
        self, request: HttpRequest, obj: Any = None, change: bool = False, **kwargs: Any
    ) -> Any:
        form = super().get_form(request, obj, change, **kwargs)  # type: ignore[misc]
        refused = getattr(request, "_dlock_refused", None)
        if not isinstance(refused, str):
            return form
        message: str = refused

        class RefusedForm(form):  # type: ignore[misc, valid-type]
            def clean(self) -> Any:
                cleaned = super().clean()
                self.add_error(None, ValidationError(message, code="locked"))
                return cleaned

        return RefusedForm

    def delete_view(
        self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        try:
            return super().delete_view(request, object_id, extra_context)  # type: ignore[misc, no-any-return]
        except LockTimeout as e:
            return self._refused(request, _refusal(e, "deleted"))

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        try:
            return super().changelist_view(request, extra_context)  # type: ignore[misc, no-any-return]
        except LockTimeout as e:
            return self._refused(request, _refusal(e, "saved"))

    def _refused(self, request: HttpRequest, message: str) -> HttpResponse:
        messages.error(request, message)
        return HttpResponseRedirect(request.get_full_path())


def _refusal(error: LockTimeout, done: str) -> str:
    return (
        f"Not {done}: this object is being changed elsewhere (its lock {error.name!r} is "
        "held). Nothing was changed; try again in a moment."
    )


class LockedModelAdmin(LockedModelAdminMixin, admin.ModelAdmin):  # type: ignore[type-arg]
    """A ``ModelAdmin`` for ``LockedSaveMixin`` models; see :class:`LockedModelAdminMixin`."""
