from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []
    operations = [
        migrations.CreateModel(
            name="Counter",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("value", models.IntegerField(default=0)),
            ],
        ),
    ]
