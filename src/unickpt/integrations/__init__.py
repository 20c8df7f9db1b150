"""Integrations of unickpt with training frameworks, one module each (``unickpt.integrations.lightning``,
...); each imports its framework, so none is imported by ``import unickpt``."""
