from django.http import HttpRequest, HttpResponse

from django_dlock import lock, semaphore

from .models import Counter


def increment(request: HttpRequest, pk: int) -> HttpResponse:
    """Read, add one, write under a lock (and a semaphore), held to the commit if there is one."""
    with (
        semaphore("increments", limit=8, timeout=60),
        lock(f"counter:{pk}", timeout=60, release_on_commit=True),
    ):
        counter = Counter.objects.get(pk=pk)
        counter.value += 1
        counter.save()
    return HttpResponse(str(counter.value))
