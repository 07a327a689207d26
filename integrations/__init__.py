"""Integrations with training frameworks and loggers, importable as ``opbc_metrics.integrations``."""
