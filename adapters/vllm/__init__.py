"""DASH for vLLM: the plugin (``plugin.register``), the backend (``backend``) and the DASH Llama (``models``).

Importing this package imports nothing from vLLM; ``backend`` and ``models`` need it.
"""
