"""Peer caches measured beside lmcached on the same shapes: Redis and LMCache."""
