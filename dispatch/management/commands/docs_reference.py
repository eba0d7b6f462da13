"""`manage.py docs_reference`: write docs/reference.md from the code, or check it is current."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from cuesched_project import docgen


class Command(BaseCommand):
    help = (
        "Write docs/reference.md (every local management command with its options, the metrics, the "
        "settings) from the code; --check exits non-zero when the file is stale."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--check",
            action="store_true",
            help="Write nothing; exit 1 when docs/reference.md differs from what the code renders.",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        text = docgen.render()
        path = docgen.REFERENCE_PATH
        if options["check"]:
            if not path.exists() or path.read_text() != text:
                raise CommandError(f"{path} is stale: run `manage.py docs_reference` and commit the result")
            self.stdout.write(f"{path} is up to date")
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        self.stdout.write(f"wrote {path}")
