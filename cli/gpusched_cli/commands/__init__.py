"""The CLI's commands, one module per group of them; `gpusched_cli.main.COMMANDS` says which is where."""
