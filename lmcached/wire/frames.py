"""Frames: how one message travels on the daemon's socket, both ways.

Why this file exists: the daemon's loop (lmcached/daemon/connection.py) and the clients'
blocking `Connection` (connection.py) cut the same byte stream into the same frames;
the encoder and the two decoders are built once, here.

Frame::

    +----------------------+-----------------------------------------------+
    | length: u32 little   | msgspec msgpack of one tagged Struct (array)  |
    +----------------------+-----------------------------------------------+

A frame longer than MAX_FRAME_BYTES closes the connection. Encoding and decoding a small
Struct costs far less than the socket round trip itself (docs/architecture.md,
"Performance rules").
"""

import struct

import msgspec

from lmcached.wire.protocol import MAX_FRAME_BYTES, Reply, Request

FRAME_LENGTH = struct.Struct("<I")  # a frame's length prefix
_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)


def encode_frame(message: msgspec.Struct) -> bytes:
    """Length-prefixed msgpack of `message`.

    Raises:
        ValueError: the encoded message exceeds MAX_FRAME_BYTES.
    """
    payload = _encoder.encode(message)
    if len(payload) > MAX_FRAME_BYTES:
        raise ValueError(
            f"message of {len(payload)} bytes exceeds the {MAX_FRAME_BYTES}-byte frame limit"
        )
    return FRAME_LENGTH.pack(len(payload)) + payload
