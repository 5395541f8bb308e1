from rlfw.config.schema import RLConfig, register_configs
from rlfw.config.validate import ConfigError, validate

__all__ = ["ConfigError", "RLConfig", "register_configs", "validate"]
