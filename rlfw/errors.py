"""Errors every layer may raise, in a module that imports nothing of rlfw, so raising one pulls in no layer above."""


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key and says what to change."""
