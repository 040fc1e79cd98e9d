"""ipu: see docs/architecture.md."""
