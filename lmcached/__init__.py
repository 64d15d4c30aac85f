"""lmcached: a local KV-cache daemon that keeps LLM KV cache in shared memory.

Packages: `lmcached` (daemon, protocol, CLI), `lmcached.shm` (arena and block pool),
`lmcached.client` (the engine used inside worker processes). See DESIGN.md.
"""

__version__ = "0.1.0"
