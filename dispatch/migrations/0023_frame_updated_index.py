"""The index behind the console's frame list (most recently changed first).

Built CONCURRENTLY: on a live farm a plain CREATE INDEX holds off every frame update (booking,
completion) for as long as the build takes, about a second per 500,000 frames.
"""

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ("dispatch", "0022_folder_show_of_its_jobs"),
    ]

    operations = [
        AddIndexConcurrently(
            model_name="frame",
            index=models.Index(fields=["-ts_updated", "pk_frame"], name="i_frame_updated"),
        ),
    ]
