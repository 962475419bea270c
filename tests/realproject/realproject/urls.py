from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from inventory import views

urlpatterns = [
    path("counters/<slug:name>/fn/", views.bump),
    path("counters/<slug:name>/cbv/", views.BumpView.as_view()),
    path("counters/<slug:name>/async-fn/", views.abump),
    path(
        "counters/<slug:name>/async-cbv/",
        csrf_exempt(views.non_atomic(views.AsyncBumpView.as_view())),
    ),
    path("books/<slug:name>/stock/", views.stock_book),
    path("books/<slug:name>/sell/", views.sell_book),
    path("books/<slug:name>/discard/", views.discard_book),
    path("warehouses/<slug:name>/restock/", views.restock),
    path("accounts/<slug:name>/credit/", views.credit),
    path("tallies/<slug:name>/enqueue/", views.enqueue_tally),
]
