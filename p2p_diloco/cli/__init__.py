"""The ``p2p-diloco`` commands: each parses and checks its arguments (bad input: one line, exit 2, before anything
starts), builds what it needs, runs, and cleans up in ``finally``. Only the standard library is imported at module
level, so ``p2p-diloco --help`` imports neither torch nor hivemind. Nothing imports this package."""
