"""The error a data problem raises (its own module, so every data module can import it)."""


class DataError(ValueError):
    """Data that cannot be used; the message starts with the setting to change."""
