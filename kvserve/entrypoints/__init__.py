"""How users reach the engine: the ``kvserve`` command, the offline ``LLM``, the console."""
