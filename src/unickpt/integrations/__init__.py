"""Integrations of unickpt with training frameworks: one module per framework, imported
on demand (never by ``import unickpt``). See docs/INTEGRATIONS.md."""
