from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_dlock", "0001_initial"),
    ]

    operations = [
        migrations.CreateModel(
            name="Lock",
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
        migrations.AlterField(
            model_name="lease",
            name="owner",
            field=models.CharField(
                help_text="Owner token of the holder; NULL when free.", max_length=64, null=True
            ),
        ),
    ]
