from django.apps import AppConfig


class RoutingConfig(AppConfig):
    name = "routing"
    verbose_name = "Routing"

    def ready(self) -> None:
        from django.db.models.signals import post_delete, post_save

        from routing.models import Model, ModelAlias, Worker

        # Any change to a worker's row reaches every frontend's kept rows (routing.fleet.worker_rows)
        # at their next request; update() says so itself (routing.models.WorkerQuerySet).
        post_save.connect(_workers_changed, sender=Worker, dispatch_uid="saved-Worker")
        post_delete.connect(_workers_changed, sender=Worker, dispatch_uid="deleted-Worker")
        # A model's row (enabled, fingerprint) is read with the workers' rows, under their generation.
        for model in (Model, ModelAlias):
            post_save.connect(_workers_changed, sender=model, dispatch_uid=f"saved-{model.__name__}")
            post_delete.connect(_workers_changed, sender=model, dispatch_uid=f"deleted-{model.__name__}")


def _workers_changed(sender, **kwargs) -> None:
    from routing.fleet.worker_rows import workers_changed

    workers_changed()
