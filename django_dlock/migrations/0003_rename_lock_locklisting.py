from django.db import migrations


class Migration(migrations.Migration):
    """The admin's unmanaged ``Lock`` becomes ``LockListing``: no table changes.

    A rename, not a delete and a create, so that django.contrib.contenttypes
    renames the content type in place: the view_lock and break_lock
    permissions granted on it and the admin log entries of breaks stay.
    """

    dependencies = [
        ("django_dlock", "0002_lock"),
    ]

    operations = [
        migrations.RenameModel(old_name="Lock", new_name="LockListing"),
    ]
