"""The two errors the product reports in one line, importable from anywhere without importing the config (so
the pipeline, the checkpoint code and the config can all raise them without importing each other)."""


class ConfigError(ValueError):
    """A bad configuration value; its message is one line: key, value, why, fix (train.py exits 2, before any
    process group starts)."""


class RunError(RuntimeError):
    """A run that cannot go on, said in one line (train.py exits 3): no sound checkpoint to resume, too many
    non-finite steps in a row."""
