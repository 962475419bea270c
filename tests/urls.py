"""URLs for tests/test_views.py, and the metrics view for tests/test_prometheus.py."""

from django.urls import path

from django_dlock.contrib.prometheus import metrics_view
from tests import views

urlpatterns = [
    path("metrics", metrics_view),
    path("order/<int:order_id>/", views.order),
    path("redis/order/<int:order_id>/", views.order_redis),
    path("409/order/<int:order_id>/", views.order_409),
    path("waits/order/<int:order_id>/", views.order_waits),
    path("cart/", views.cart),
    path("misnamed/<int:order_id>/", views.misnamed),
    path("async/order/<int:order_id>/", views.async_order),
    path("async/pay/<int:order_id>/", views.async_pay),
    path("async/cart/", views.async_cart),
    path("staff/users/<int:user_pk>/reset/", views.reset_password),
    path("class/order/<int:order_id>/", views.OrderView.as_view()),
    path("async-class/order/<int:order_id>/", views.AsyncOrderView.as_view()),
    path("export/<str:kind>/", views.export),
    path("class/export/<str:kind>/", views.ExportView.as_view()),
]
