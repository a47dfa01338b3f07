"""DASH for SGLang: ``--attention-backend dash`` (plugin, backend) and the DASH Llama model.

``plugin.register`` is SGLang's entry point (group ``sglang.srt.plugins``); ``backend`` and
``models`` import SGLang and are loaded only inside SGLang processes.
"""
