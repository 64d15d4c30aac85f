"""The daemon (import name `lmcached.daemon`)."""
