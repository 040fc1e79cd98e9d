"""The engine's ops, one family per file (dense, embedding, norm, attention, recurrent, ...)."""
