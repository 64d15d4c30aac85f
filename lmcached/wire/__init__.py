"""The wire contract (import name `lmcached.wire`): what the daemon and its clients share."""
