"""Out-of-tree SGLang models with DASH attention (registered by ``adapters.sglang.plugin``).

SGLang's ``ModelRegistry.register(package)`` imports every module of this package and
registers each module's ``EntryClass``.
"""

from adapters.sglang.plugin import hook_memory_accounting

# Imported where SGLang resolves models (the scheduler), before it sizes the KV pool.
hook_memory_accounting()
