"""Who may read ``metrics_view``, and the label of a name without ``:``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.test import Client, override_settings

from django_dlock import lock

pytest.importorskip("prometheus_client", reason="prometheus_client is not installed")
from prometheus_client import CollectorRegistry

from django_dlock.contrib import prometheus

TOKEN = "s3cret-scrape-token"


@pytest.fixture
def metrics() -> Iterator[prometheus.Metrics]:
    installed = prometheus.install(registry=CollectorRegistry())
    with lock("access:1", backend="locmem"):
        pass
    yield installed
    prometheus.uninstall()


def scrape(client: Client, **headers: str) -> Any:
    with override_settings(ROOT_URLCONF="tests.urls"):
        return client.get("/metrics", headers=headers)


def exposes_metrics(response: Any) -> bool:
    return response.status_code == 200 and b"dlock_acquisitions_total{" in response.content


@pytest.mark.django_db
def test_anonymous_is_refused_without_a_token_setting(metrics: prometheus.Metrics) -> None:
    response = scrape(Client())
    assert response.status_code == 403
    assert b"dlock_" not in response.content
    assert scrape(Client(), Authorization="Bearer ").status_code == 403


@pytest.mark.django_db
@override_settings(DLOCK_METRICS_TOKEN=TOKEN)
def test_a_scraper_with_the_bearer_token_reads_the_metrics(metrics: prometheus.Metrics) -> None:
    assert exposes_metrics(scrape(Client(), Authorization=f"Bearer {TOKEN}"))
    for wrong in (f"Bearer {TOKEN}x", f"Basic {TOKEN}", TOKEN, "Bearer", ""):
        assert scrape(Client(), Authorization=wrong).status_code == 403, wrong
    assert scrape(Client()).status_code == 403


@pytest.mark.django_db
def test_staff_with_view_lock_reads_the_metrics_in_a_browser(
    metrics: prometheus.Metrics, django_user_model: Any, admin_user: Any
) -> None:
    staff = django_user_model.objects.create_user("ops", password="pw", is_staff=True)
    client = Client()
    client.force_login(staff)
    assert scrape(client).status_code == 403
    staff.user_permissions.add(
        Permission.objects.get(content_type__app_label="django_dlock", codename="view_lock")
    )
    client.force_login(staff)
    assert exposes_metrics(scrape(client))
    admin = Client()
    admin.force_login(admin_user)
    assert exposes_metrics(scrape(admin))
    inactive = django_user_model.objects.create_superuser("gone", password="pw", is_active=False)
    gone = Client()
    gone.force_login(inactive)
    assert scrape(gone).status_code == 403


def test_a_name_without_a_colon_is_counted_under_one_bounded_label(
    metrics: prometheus.Metrics,
) -> None:
    """An e-mail address or a user id as a lock name must not become a label value."""
    for name in ("alice@example.com", "bob@example.com", "nightly-report"):
        with lock(name, backend="locmem"):
            pass
    labels = {"backend": "locmem", "pattern": "~no-prefix"}
    assert metrics.registry.get_sample_value("dlock_acquisitions_total", labels) == 3
    exposition = b"".join(
        f"{sample}".encode() for family in metrics.registry.collect() for sample in family.samples
    )
    assert b"example.com" not in exposition
    assert b"nightly-report" not in exposition
    assert prometheus.name_pattern("alice@example.com") == prometheus.NO_PREFIX == "~no-prefix"
    assert prometheus.name_pattern("report:2024-06") == "report:*"


@pytest.mark.django_db
@override_settings(DLOCK_METRICS_TOKEN=TOKEN)
def test_a_wrong_token_is_refused_even_for_a_permitted_user(
    metrics: prometheus.Metrics, admin_user: Any
) -> None:
    client = Client()
    client.force_login(admin_user)
    assert scrape(client, Authorization="Bearer nope").status_code == 403
    assert exposes_metrics(scrape(client))


def test_a_fixed_name_as_a_decorators_key_keeps_its_own_label(
    metrics: prometheus.Metrics,
) -> None:
    @lock("nightly-report", backend="locmem")
    def nightly() -> None:
        pass

    nightly()
    labels = {"backend": "locmem", "pattern": "nightly-report"}
    assert metrics.registry.get_sample_value("dlock_acquisitions_total", labels) == 1
