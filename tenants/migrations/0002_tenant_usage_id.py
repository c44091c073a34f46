"""Each tenant's usage is keyed by a UUID of its own (a database id repeats in a new database).

Added nullable, filled one row at a time (a callable default gives every existing row the
same value), then made unique: Django's recipe for a unique field on a table with rows."""

import uuid

from django.db import migrations, models


def give_each_tenant_a_usage_id(apps, schema_editor) -> None:
    Tenant = apps.get_model("tenants", "Tenant")
    for tenant in Tenant.objects.using(schema_editor.connection.alias).filter(usage_id=None):
        tenant.usage_id = uuid.uuid4()
        tenant.save(update_fields=["usage_id"])


class Migration(migrations.Migration):
    dependencies = [
        ("tenants", "0001_initial"),
    ]

    operations = [
        migrations.AddField(
            model_name="tenant",
            name="usage_id",
            field=models.UUIDField(editable=False, null=True),
        ),
        migrations.RunPython(give_each_tenant_a_usage_id, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="tenant",
            name="usage_id",
            field=models.UUIDField(default=uuid.uuid4, editable=False, unique=True),
        ),
    ]
