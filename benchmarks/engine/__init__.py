"""The client engine's store/retrieve path and the daemon's bookkeeping, measured."""
