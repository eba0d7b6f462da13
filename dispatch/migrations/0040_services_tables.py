"""Cuebot's service and show_service tables, with Cuebot's columns in Cuebot's order, types,
defaults and index names (dispatch.models.services), and the farm-action kinds of their audited edits."""

import dispatch.models.base
import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('dispatch', '0038_frame_mem_env'),
    ]

    operations = [
        migrations.AlterField(
            model_name='farmaction',
            name='str_target_kind',
            field=models.CharField(choices=[('job', 'job'), ('frame', 'frame'), ('host', 'host'), ('facility', 'facility'), ('alloc', 'alloc'), ('show', 'show'), ('sub', 'sub'), ('service', 'service'), ('show_svc', 'show_svc')], max_length=8),
        ),
        migrations.CreateModel(
            name='Service',
            fields=[
                ('pk_service', models.CharField(db_column='pk_service', default=dispatch.models.base.new_id, editable=False, max_length=36, primary_key=True, serialize=False)),
                ('str_name', models.CharField(max_length=36)),
                ('b_threadable', models.BooleanField()),
                ('int_cores_min', models.IntegerField()),
                ('int_mem_min', models.IntegerField()),
                ('str_tags', models.CharField(max_length=128)),
                ('int_cores_max', models.IntegerField(db_default=0, default=0)),
                ('int_gpu_mem_min', models.BigIntegerField(db_default=0, default=0)),
                ('int_gpus_min', models.IntegerField(db_default=0, default=0)),
                ('int_gpus_max', models.IntegerField(db_default=0, default=0)),
                ('int_timeout', models.IntegerField(db_default=0, default=0)),
                ('int_timeout_llu', models.IntegerField(db_default=0, default=0)),
                ('int_min_memory_increase', models.IntegerField(db_default=2097152, default=2097152)),
            ],
            options={
                'db_table': 'service',
                'indexes': [models.Index(fields=['int_gpu_mem_min'], name='i_service_int_gpu_mem_min'), models.Index(fields=['int_gpus_min'], name='i_service_int_gpus_min')],
                'constraints': [models.UniqueConstraint(fields=('str_name',), name='i_service_str_name')],
            },
        ),
        migrations.CreateModel(
            name='ShowService',
            fields=[
                ('pk_show_service', models.CharField(db_column='pk_show_service', default=dispatch.models.base.new_id, editable=False, max_length=36, primary_key=True, serialize=False)),
                ('show', models.ForeignKey(db_column='pk_show', db_index=False, on_delete=django.db.models.deletion.DO_NOTHING, related_name='service_overrides', to='dispatch.show')),
                ('str_name', models.CharField(max_length=36)),
                ('b_threadable', models.BooleanField()),
                ('int_cores_min', models.IntegerField()),
                ('int_mem_min', models.IntegerField()),
                ('str_tags', models.CharField(max_length=128)),
                ('int_cores_max', models.IntegerField(db_default=0, default=0)),
                ('int_gpu_mem_min', models.BigIntegerField(db_default=0, default=0)),
                ('int_gpus_min', models.IntegerField(db_default=0, default=0)),
                ('int_gpus_max', models.IntegerField(db_default=0, default=0)),
                ('int_timeout', models.IntegerField(db_default=0, default=0)),
                ('int_timeout_llu', models.IntegerField(db_default=0, default=0)),
                ('int_min_memory_increase', models.IntegerField(db_default=2097152, default=2097152)),
            ],
            options={
                'verbose_name': 'show service override',
                'db_table': 'show_service',
                'indexes': [models.Index(fields=['int_gpu_mem_min'], name='i_show_service_int_gpu_mem_min'), models.Index(fields=['int_gpus_min'], name='i_show_service_int_gpus_min')],
                'constraints': [models.UniqueConstraint(fields=('str_name', 'show'), name='i_show_service_str_name')],
            },
        ),
    ]
