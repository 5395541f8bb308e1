"""Megatron-core under rlfw: the model, its trainers and the CPU shims. Importing this package imports megatron-core
without the parts of its import that rlfw's training never uses (``rlfw.megatron.lean_import``)."""

from rlfw.megatron.lean_import import import_megatron_core

import_megatron_core()
