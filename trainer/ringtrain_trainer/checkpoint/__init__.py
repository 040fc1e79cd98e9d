"""checkpoint: see docs/architecture.md."""
