from django.urls import path
from pgapp import views

urlpatterns = [path("increment/<int:pk>/", views.increment)]
