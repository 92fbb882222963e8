"""CLI subcommands that need only the runtime."""
