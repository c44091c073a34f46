from django.apps import AppConfig


class InferencePlatformConfig(AppConfig):
    name = "inference_platform"
    verbose_name = "Inference platform"

    def ready(self) -> None:
        from django.conf import settings

        from routing.state.redis_keys import configure_timeouts

        configure_timeouts(settings.REDIS_TIMEOUT_SECS)
