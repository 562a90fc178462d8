"""``python -m trainyard_cli`` is the ``trainyard`` command."""

from trainyard_cli.main import app

app(prog_name="trainyard")
