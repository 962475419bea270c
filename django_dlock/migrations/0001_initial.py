from django.db import migrations, models


class Migration(migrations.Migration):
    """The database backend's tables, and the admin's unmanaged Locks entry."""

    initial = True

    dependencies = []

    operations = [
        migrations.CreateModel(
            name="Lease",
            fields=[
                (
                    "digest",
                    models.CharField(
                        help_text="SHA-256 of KEY_PREFIX and name: names may be longer than an index allows.",
                        max_length=64,
                        primary_key=True,
                        serialize=False,
                    ),
                ),
                (
                    "namespace",
                    models.CharField(
                        default="", help_text="The backend's KEY_PREFIX.", max_length=255
                    ),
                ),
                ("name", models.TextField()),
                (
                    "fence",
                    models.BigIntegerField(
                        help_text="The last fencing token issued for this name."
                    ),
                ),
                (
                    "owner",
                    models.CharField(
                        help_text="Owner token of the holder; NULL when free.",
                        max_length=64,
                        null=True,
                    ),
                ),
                ("acquired_at_us", models.BigIntegerField(null=True)),
                ("expires_at_us", models.BigIntegerField(db_index=True, null=True)),
                ("holder", models.TextField(default="", help_text="Holder metadata as JSON.")),
            ],
            options={
                "verbose_name": "lease",
                "verbose_name_plural": "leases",
            },
        ),
        migrations.CreateModel(
            name="ParkedCall",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "digest",
                    models.CharField(db_index=True, help_text="As Lease.digest.", max_length=64),
                ),
                (
                    "namespace",
                    models.CharField(
                        default="", help_text="The backend's KEY_PREFIX.", max_length=255
                    ),
                ),
                ("name", models.TextField()),
                ("call_id", models.CharField(help_text="The task id.", max_length=255)),
                (
                    "place",
                    models.BigIntegerField(help_text="Its place in line (smaller first)."),
                ),
                ("payload", models.TextField(help_text="What sends it again, as JSON.")),
            ],
            options={
                "verbose_name": "parked call",
                "constraints": [
                    models.UniqueConstraint(
                        fields=("digest", "call_id"), name="django_dlock_parked_call"
                    )
                ],
            },
        ),
        migrations.CreateModel(
            name="Slot",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                (
                    "digest",
                    models.CharField(db_index=True, help_text="As Lease.digest.", max_length=64),
                ),
                (
                    "namespace",
                    models.CharField(
                        default="", help_text="The backend's KEY_PREFIX.", max_length=255
                    ),
                ),
                ("name", models.TextField()),
                ("owner", models.CharField(max_length=64)),
                ("slot_limit", models.BigIntegerField(help_text="The semaphore's limit.")),
                (
                    "weight",
                    models.BigIntegerField(help_text="1, or the whole limit for a writer."),
                ),
                ("token", models.BigIntegerField(help_text="NULL for a waiter.", null=True)),
                ("acquired_at_us", models.BigIntegerField(null=True)),
                ("expires_at_us", models.BigIntegerField(db_index=True)),
                ("holder", models.TextField(default="", help_text="Holder metadata as JSON.")),
            ],
            options={
                "verbose_name": "semaphore slot",
                "constraints": [
                    models.UniqueConstraint(fields=("digest", "owner"), name="django_dlock_slot_owner")
                ],
            },
        ),
        migrations.CreateModel(
            name="LockListing",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
            ],
            options={
                "verbose_name": "lock",
                "verbose_name_plural": "locks",
                "permissions": [
                    ("view_lock", "Can view held locks"),
                    ("break_lock", "Can break held locks"),
                ],
                "managed": False,
                "default_permissions": (),
            },
        ),
    ]
