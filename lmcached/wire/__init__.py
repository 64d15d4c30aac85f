"""The wire contract (import name `lmcached.wire`): what the daemon and its clients share.

What lives here:
    protocol.py                messages and their limits, block references (tier, block)
    frames.py                  a message's frame on the socket: encoder and decoders
    connection.py              the blocking `Connection` clients use, HELLO, CLIENTS
    record_format.py           the chunk prefix hash chain and the record header (one
                               writer, one parser) that readers verify
    socket_path.py             where the daemon's socket lives, and whether its directory
                               can be trusted
    envs.py                    every LMCACHED_* environment variable, read in one place
    units.py                   byte counts for people: INFO's `*_human`, sizes in messages
    extras.py                  `install_hint`: how to install an extra (checkout or index)
    logger.py                  `init_logger`: one logger factory for every layer

What it may import: the standard library, msgspec, numpy and xxhash; nothing else of
lmcached. Everything above imports it.
"""
