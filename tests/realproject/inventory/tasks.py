from django_dlock.celery import locked_task

from .models import Tally


@locked_task(key="tally:{name}", on_locked="wait", timeout=60, ttl=30)
def bump_tally(name: str) -> int:
    """Read, add one, write: the task's lock keeps concurrent runs whole."""
    tally, _ = Tally.objects.get_or_create(name=name)
    tally.value += 1
    tally.save(update_fields=["value"])
    return tally.value
