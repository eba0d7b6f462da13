from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("accounting", "0005_outside_ledger"),
    ]

    operations = [
        migrations.AddField(
            model_name="schedulerlease",
            name="ts_deadline",
            field=models.DateTimeField(null=True),
        ),
    ]
