from rlfw.config.schema import RLConfig, register_configs
from rlfw.config.validate import validate
from rlfw.errors import ConfigError

__all__ = ["ConfigError", "RLConfig", "register_configs", "validate"]
