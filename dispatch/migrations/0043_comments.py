"""Cuebot's comments table (dispatch.models.comments), with Cuebot's columns in Cuebot's order,
types, default and index names. On a Cuebot database the table exists and is Cuebot's: adoption
adds nothing to it (tests/integration/test_cuebot_adoption.py)."""

import dispatch.models.base
import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('dispatch', '0042_deps_cross_job'),
    ]

    operations = [
        migrations.CreateModel(
            name='Comment',
            fields=[
                ('pk_comment', models.CharField(db_column='pk_comment', default=dispatch.models.base.new_id, editable=False, max_length=36, primary_key=True, serialize=False)),
                ('job', models.ForeignKey(blank=True, db_column='pk_job', db_index=False, null=True, on_delete=django.db.models.deletion.DO_NOTHING, related_name='comments', to='dispatch.job')),
                ('host', models.ForeignKey(blank=True, db_column='pk_host', db_index=False, null=True, on_delete=django.db.models.deletion.DO_NOTHING, related_name='comments', to='dispatch.host')),
                ('ts_created', dispatch.models.base.CuebotLocalTimestamp(db_default=dispatch.models.base.CurrentTimestamp())),
                ('str_user', models.CharField(max_length=36)),
                ('str_subject', models.CharField(max_length=128)),
                ('str_message', models.CharField(max_length=4000)),
            ],
            options={
                'db_table': 'comments',
                'indexes': [models.Index(fields=['job'], name='i_comment_pk_job'), models.Index(fields=['host'], name='i_comment_pk_host')],
            },
        ),
    ]
