"""The `dali` command line."""
