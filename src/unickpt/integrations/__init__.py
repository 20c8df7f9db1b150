"""Integrations of unickpt with training frameworks, one module each (imported on demand,
never by ``import unickpt``): see docs/INTEGRATIONS.md."""
