from django.apps import AppConfig


class TenantsConfig(AppConfig):
    name = "tenants"
    verbose_name = "Tenants and API keys"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.db.models.signals import post_delete, post_save

        from tenants.models import ApiKey, Tenant

        # Any change to a key or a tenant (limits, sharing) reaches every frontend's verified
        # keys (tenants.keys.VerifiedKeys) at their next request.
        for model in (ApiKey, Tenant):
            post_save.connect(_keys_changed, sender=model, dispatch_uid=f"saved-{model.__name__}")
            post_delete.connect(_keys_changed, sender=model, dispatch_uid=f"deleted-{model.__name__}")


def _keys_changed(sender, **kwargs) -> None:
    from tenants.keys import keys_changed

    keys_changed()
