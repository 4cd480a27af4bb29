"""Core contracts: errors, configs, families, the store, progress, locks, timing. Light at import."""
