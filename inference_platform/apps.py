from django.apps import AppConfig


class InferencePlatformConfig(AppConfig):
    name = "inference_platform"
    verbose_name = "Inference platform"
