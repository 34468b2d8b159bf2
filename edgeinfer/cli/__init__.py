"""The `edgeinfer` command line: main.py (the subcommands), serve.py (serve, daemon, chat), options.py."""
