"""URL map: the OpenAI-compatible API under /v1/, the operators' admin under /admin/."""

from django.contrib import admin
from django.templatetags.static import static
from django.urls import include, path
from django.views.generic import RedirectView

from inference_platform import admin_dashboard, health, metrics
from inference_platform.api import openapi, views

# The admin's "View site" link went to "/", which served nothing: it now names the API's docs,
# and "/" itself (what `make run` users open first) leads to the admin.
admin.site.site_url = "/v1/docs"

urlpatterns = [
    path("", RedirectView.as_view(url="/admin/", permanent=False), name="root"),
    # Browsers ask every page's host for it (the API docs page names none): the admin's icon.
    path("favicon.ico", RedirectView.as_view(url=static("favicon.svg"), permanent=True)),
    path("admin/", include(admin_dashboard.urlpatterns)),  # before the admin's catch-all
    path("admin/", admin.site.urls),
    path("metrics", metrics.metrics, name="metrics"),
    path("health", health.health, name="health"),
    path("ready", health.ready, name="ready"),
    path("v1/chat/completions", views.chat_completions, name="chat-completions"),
    path("v1/models", views.list_models, name="models"),
    path("v1/models/<path:model_id>", views.retrieve_model, name="model"),
    path("v1/openapi.json", openapi.openapi_json, name="openapi"),
    path("v1/docs", openapi.docs, name="api-docs"),
    path("v1/route", views.route, name="route"),
]

handler404 = "inference_platform.api.views.not_found"
handler500 = "inference_platform.api.views.server_error"
