"""Subcommands of the kvferry CLI: each module has add_arguments(parser) and run(args) -> int."""
