"""The admin's "Locks" page: live leases on every backend, and a guarded "Break".

There is no table behind it (``models.LockListing`` is unmanaged): the views list
from the backends through :mod:`django_dlock.holders`, like
``manage.py locks``. Viewing needs ``django_dlock.view_lock``; breaking needs
``django_dlock.break_lock``, a POST with a CSRF token, and a second POST
from the confirmation page. Each break is written to the admin log and sends
``lock_broken``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any
from urllib.parse import parse_qsl, urlencode

from django.contrib import admin, messages
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.views.decorators.http import require_POST

from . import holders
from .backends.base import LockInfo
from .exceptions import DLockError
from .handler import locks
from .models import LockListing

#: Leases per page.
PER_PAGE = 100
#: Seconds between reloads of the list unless ``?refresh=`` says otherwise (0: off).
REFRESH = 10
REFRESH_CHOICES = (0, 5, 10, 30, 60)
#: The admin model's name before it was renamed LockListing; its URL names still work.
OLD_MODEL_NAME = "lock"


@admin.register(LockListing)
class LockAdmin(admin.ModelAdmin):  # type: ignore[type-arg]
    holders_template = "admin/django_dlock/lock/holders.html"
    confirmation_template = "admin/django_dlock/lock/break_confirmation.html"

    # Nothing is added, changed or deleted here; viewing is the view_lock
    # permission. It kept the codename it had when the model was called Lock,
    # so ModelAdmin's default check (view_<model name>) would not find it.
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
        urls = []
        # The names the model had as ``Lock`` (django_dlock_lock_changelist,
        # django_dlock_lock_break) still reverse, to the new paths.
        for model_name in (self.opts.model_name, OLD_MODEL_NAME):
            prefix = f"{self.opts.app_label}_{model_name}"
            urls += [
                path("", changelist, name=f"{prefix}_changelist"),
                path("break/", break_, name=f"{prefix}_break"),
            ]
        return urls

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        aliases = list(locks)
        backend = request.GET.get("backend") or None
        if backend is not None and backend not in aliases:
            backend = None
        query = request.GET.get("q", "").strip()
        refresh = _refresh(request.GET.get("refresh"))
        listing = holders.current_holders(backend)
        found = listing.holders
        if query:
            needle = query.casefold()
            found = [info for info in found if needle in info.name.casefold()]
        paginator = Paginator(found, PER_PAGE)
        page = paginator.get_page(request.GET.get("p"))
        now = listing.taken_at
        params = {"backend": backend or "", "q": query, "refresh": refresh}

        def url(**changes: Any) -> str:
            merged = {**params, **changes}
            return "?" + urlencode({k: v for k, v in merged.items() if v not in ("", None)})

        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": "Locks",
            "subtitle": None,
            "rows": [_row(info, now) for info in page.object_list],
            "page": page,
            "page_links": [
                (number, url(p=number)) for number in paginator.get_elided_page_range(page.number)
            ],
            "total": paginator.count,
            "backends": [
                (alias, alias == backend, url(backend=alias, p=None)) for alias in aliases
            ],
            "all_backends_url": url(backend=None, p=None),
            "backend": backend,
            "query": query,
            "errors": listing.errors,
            "refresh": refresh,
            "refresh_choices": [
                (seconds, seconds == refresh, url(refresh=seconds)) for seconds in REFRESH_CHOICES
            ],
            "taken_at": now,
            "columns": [column.capitalize() for column in holders.COLUMNS],
            "can_break": self.has_break_permission(request),
            "filters": url()[1:],
            **(extra_context or {}),
        }
        request.current_app = self.admin_site.name
        return TemplateResponse(request, self.holders_template, context)

    def break_view(self, request: HttpRequest) -> HttpResponse:
        """POST backend, name, token: the confirmation page; with ``confirm``: the break."""
        if not self.has_break_permission(request):
            raise PermissionDenied
        changelist = reverse(
            f"{self.admin_site.name}:{self.opts.app_label}_{self.opts.model_name}_changelist"
        ) + _list_query(request.POST.get("filters", ""))
        alias = request.POST.get("backend", "")
        name = request.POST.get("name", "")
        try:
            token = int(request.POST.get("token", ""))
        except ValueError:
            token = None
        if alias not in list(locks) or not name or token is None:
            messages.error(request, "That break request did not name a lock and its token.")
            return HttpResponseRedirect(changelist)
        listing = holders.find_holders(name, alias)
        if listing.errors:
            messages.error(request, f"{alias}: {listing.errors[alias]}")
            return HttpResponseRedirect(changelist)
        current = next((info for info in listing.holders if info.token == token), None)
        if current is None:
            messages.warning(
                request,
                f"Nothing broken: the lease on {name!r} with token {token} on {alias} has "
                "been released or taken again since it was listed.",
            )
            return HttpResponseRedirect(changelist)
        if request.POST.get("confirm") != "yes":
            context = {
                **self.admin_site.each_context(request),
                "opts": self.opts,
                "title": "Are you sure?",
                "subtitle": None,
                "row": _row(current, listing.taken_at),
                "changelist_url": changelist,
                "filters": request.POST.get("filters", ""),
            }
            request.current_app = self.admin_site.name
            return TemplateResponse(request, self.confirmation_template, context)
        try:
            broken = holders.break_holder(current)
        except DLockError as e:
            messages.error(request, f"{alias}: {e}")
            return HttpResponseRedirect(changelist)
        label = holders.holder_label(current.holder)
        if not broken:
            messages.warning(
                request,
                f"Nothing broken: the lease on {name!r} with token {token} on {alias} ended "
                "just before the break.",
            )
            return HttpResponseRedirect(changelist)
        LogEntry.objects.create(
            user_id=request.user.pk,
            content_type_id=ContentType.objects.get_for_model(LockListing).pk,
            object_id=f"{alias}:{name}",
            object_repr=name[:200],
            action_flag=DELETION,
            change_message=(
                f"Broke the lease on {name!r} on backend {alias!r} "
                f"(fencing token {token}, held by {label})."
            ),
        )
        messages.success(
            request, f"Broke the lease on {name!r} on {alias} (token {token}, held by {label})."
        )
        return HttpResponseRedirect(changelist)


def _list_query(filters: str) -> str:
    """The list's own parameters from ``filters``, to go back to the page the user was on."""
    kept = [
        (key, value)
        for key, value in parse_qsl(filters)
        if key in ("backend", "q", "p", "refresh")
    ]
    return f"?{urlencode(kept)}" if kept else ""


def _refresh(value: str | None) -> int:
    try:
        seconds = int(value) if value is not None else REFRESH
    except ValueError:
        return REFRESH
    return seconds if seconds in REFRESH_CHOICES else REFRESH


def _row(info: LockInfo, now: datetime) -> dict[str, Any]:
    cells = holders.columns(info, now)
    return {
        "info": info,
        "cells": cells,
        "details": [(key, info.holder[key]) for key in info.holder],
        "acquired_at": info.acquired_at,
        "expires_at": None if cells[-1] == "never" else info.expires_at,
    }
