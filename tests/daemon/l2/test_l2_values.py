"""L2 keys and values (lmcached/daemon/spill/envelope.py): pure, no Redis.

A value fetched from L2 is served only when it is the record that was written for that
chunk of that namespace. Each way a value can be wrong is built here by hand and must
be refused with its own reason; any single flipped byte must be refused; fingerprints
and keys are literals that every node must agree on.
"""

import subprocess
import sys

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcached.daemon.l2.values import l2_key
from lmcached.daemon.spill.envelope import (
    ENVELOPE,
    ENVELOPE_BYTES,
    VerifyError,
    encode_value,
    encode_envelope,
    namespace_fingerprint,
    verify_parts,
    verify_value,
)
from lmcached.wire.protocol import Layout
from lmcached.wire.record_format import (
    RECORD_HEADER,
    RECORD_HEADER_BYTES,
    RECORD_MAGIC,
    ROOT_HASH,
    hash_block_tokens,
)

LAYOUT = Layout("demo-model", 2, 1, "vllm", "bfloat16", 4, 2, 64, 256, 1 << 20)
# xxh3_128 (seed 0x6C6D63616368) of msgspec's msgpack of LAYOUT, computed once; a change
# here means every value in every L2 becomes a miss (or, between versions, mixes).
LAYOUT_FP_HEX = "a51ebc7978ca945f9aac717b7efe9db9"
FP = bytes.fromhex(LAYOUT_FP_HEX)
OTHER_FP = namespace_fingerprint(msgspec.structs.replace(LAYOUT, worker_id=0))


def make_record(parent: bytes, tokens, kv_bytes: int = 300, seed: int = 0,
                header_hash: bytes | None = None, magic: int = RECORD_MAGIC,
                num_tokens: int | None = None) -> tuple[bytes, bytes]:
    """(chunk hash, record): header, int64 LE token ids at offset 64, random KV bytes.

    The header's chunk hash, magic and token count can be made to lie.
    """
    token_bytes = np.asarray(tokens, dtype="<i8").tobytes()
    chunk_hash = hash_block_tokens(parent, token_bytes)
    header = RECORD_HEADER.pack(magic, len(tokens) if num_tokens is None else num_tokens,
                                0x1234, chunk_hash if header_hash is None else header_hash)
    header += bytes(RECORD_HEADER_BYTES - len(header))
    kv = np.random.default_rng(seed).bytes(kv_bytes)
    return chunk_hash, header + token_bytes + kv


def refused(value, fp=FP, chunk_hash=None, parent=ROOT_HASH) -> str:
    with pytest.raises(VerifyError) as info:
        verify_value(value, fp, chunk_hash, parent)
    return info.value.reason


def test_round_trip_of_a_chain_returns_each_record_bytes_equal_without_a_copy():
    h0, rec0 = make_record(ROOT_HASH, range(16), seed=1)
    h1, rec1 = make_record(h0, range(16, 32), seed=2)
    # The second record comes in three pieces, as a value that spans three arena blocks.
    pieces = [memoryview(rec1)[:100], bytearray(rec1[100:250]), rec1[250:]]
    v0, v1 = encode_value(FP, h0, [rec0]), encode_value(FP, h1, pieces)
    assert len(v0) == ENVELOPE_BYTES + len(rec0) and len(v1) == ENVELOPE_BYTES + len(rec1)
    assert v1[ENVELOPE_BYTES:] == rec1
    out0, out1 = verify_value(v0, FP, h0, ROOT_HASH), verify_value(v1, FP, h1, h0)
    assert bytes(out0) == rec0 and bytes(out1) == rec1
    assert out1.obj is v1, "the record is a view into the value, not a copy"


def test_pieces_of_any_format_count_bytes_not_items():
    h, rec = make_record(ROOT_HASH, range(8))
    as_int64 = np.frombuffer(rec[:RECORD_HEADER_BYTES + 64], dtype="<i8")  # 16 items
    value = encode_value(FP, h, [memoryview(as_int64), rec[RECORD_HEADER_BYTES + 64:]])
    assert bytes(verify_value(value, FP, h, ROOT_HASH)) == rec


@pytest.mark.parametrize("cuts", [(100,), (30, 90, 200), (RECORD_HEADER_BYTES + 5,)])
def test_an_envelope_and_a_record_apart_are_checked_as_one_value(cuts):
    """A disk tier slot: the envelope in a page of its own, the record in arena blocks
    (pieces cut inside the header or the token ids are joined for those checks only)."""
    parent, _ = make_record(ROOT_HASH, range(16))
    h, rec = make_record(parent, range(16, 32))
    bounds = [0, *cuts, len(rec)]
    pieces = [memoryview(rec)[a:b] for a, b in zip(bounds, bounds[1:])]
    envelope = encode_envelope(FP, h, pieces) + bytes(4096 - ENVELOPE_BYTES)  # a page
    verify_parts(envelope, pieces, FP, h, parent)
    with pytest.raises(VerifyError) as refused:
        verify_parts(envelope, pieces[:-1], FP, h, parent)  # a record cut short
    assert refused.value.reason == "envelope"
    tampered = [bytearray(piece) for piece in pieces]
    tampered[-1][-1] ^= 1
    with pytest.raises(VerifyError) as refused:
        verify_parts(envelope, tampered, FP, h, parent)
    assert refused.value.reason == "checksum"


def _tampered(kind: str) -> tuple[bytes, bytes, bytes, str]:
    """(value, chunk hash asked for, parent, expected reason) for one kind of bad value."""
    parent, _ = make_record(ROOT_HASH, range(16))
    h, rec = make_record(parent, range(16, 32))
    good = encode_value(FP, h, [rec])
    if kind == "flipped_kv_byte":
        value = bytearray(good)
        value[-1] ^= 0x01
        return bytes(value), h, parent, "checksum"
    if kind == "flipped_token_byte":
        value = bytearray(good)
        value[ENVELOPE_BYTES + RECORD_HEADER_BYTES] ^= 0x80
        return bytes(value), h, parent, "checksum"
    if kind == "other_namespace":  # another namespace's value under a colliding key
        return encode_value(OTHER_FP, h, [rec]), h, parent, "foreign"
    if kind == "other_chunk_in_envelope":
        other, rec_other = make_record(parent, range(100, 116))
        return encode_value(FP, other, [rec_other]), h, parent, "foreign"
    if kind == "tokens_not_hashing":  # header says h, ids are others; checksum recomputed
        _, rec_bad = make_record(parent, range(500, 516), header_hash=h)
        return encode_value(FP, h, [rec_bad]), h, parent, "tokens"
    if kind == "record_of_another_chunk":  # a valid record of another prompt
        _, rec_other = make_record(parent, range(100, 116))
        return encode_value(FP, h, [rec_other]), h, parent, "tokens"
    if kind == "other_parent":  # the same tokens after another prefix
        return good, h, ROOT_HASH, "tokens"
    if kind == "record_magic":
        _, rec_bad = make_record(parent, range(16, 32), magic=RECORD_MAGIC ^ 1)
        return encode_value(FP, h, [rec_bad]), h, parent, "tokens"
    if kind == "more_tokens_than_bytes":
        _, rec_bad = make_record(parent, range(16, 32), kv_bytes=0, num_tokens=17)
        return encode_value(FP, h, [rec_bad]), h, parent, "tokens"
    if kind == "no_tokens":
        _, rec_bad = make_record(parent, range(16, 32), num_tokens=0)
        return encode_value(FP, h, [rec_bad]), h, parent, "tokens"
    if kind == "record_shorter_than_its_header":
        return encode_value(FP, h, [rec[:40]]), h, parent, "tokens"
    if kind == "truncated":
        return good[:-1], h, parent, "envelope"
    if kind == "shorter_than_envelope":
        return good[:ENVELOPE_BYTES - 1], h, parent, "envelope"
    if kind == "bad_magic":
        return b"LMKV" + good[4:], h, parent, "envelope"
    if kind == "other_version":
        return good[:4] + (2).to_bytes(2, "little") + good[6:], h, parent, "envelope"
    if kind == "flags":
        return good[:6] + (1).to_bytes(2, "little") + good[8:], h, parent, "envelope"
    if kind == "pad":
        return good[:ENVELOPE_BYTES - 1] + b"\1" + good[ENVELOPE_BYTES:], h, parent, "envelope"
    raise AssertionError(kind)


TAMPER_KINDS = ["flipped_kv_byte", "flipped_token_byte", "other_namespace",
                "other_chunk_in_envelope", "tokens_not_hashing", "record_of_another_chunk",
                "other_parent", "record_magic", "more_tokens_than_bytes", "no_tokens",
                "record_shorter_than_its_header", "truncated", "shorter_than_envelope",
                "bad_magic", "other_version", "flags", "pad"]


@pytest.mark.parametrize("kind", TAMPER_KINDS)
def test_each_bad_value_is_refused_with_its_reason(kind):
    value, chunk_hash, parent, reason = _tampered(kind)
    assert refused(value, chunk_hash=chunk_hash, parent=parent) == reason


def test_tokens_check_is_the_only_one_that_catches_a_consistent_envelope():
    """The 'tokens_not_hashing' value passes every check before the token hash."""
    value, chunk_hash, parent, _ = _tampered("tokens_not_hashing")
    magic, version, flags, length, checksum, fp, h = ENVELOPE.unpack_from(value)
    assert (fp, h, length) == (FP, chunk_hash, len(value) - ENVELOPE_BYTES)
    assert RECORD_HEADER.unpack_from(value, ENVELOPE_BYTES)[3] == chunk_hash


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=20),
       kv_bytes=st.integers(0, 200), data=st.data())
def test_any_single_flipped_byte_is_refused(tokens, kv_bytes, data):
    h, rec = make_record(ROOT_HASH, tokens, kv_bytes=kv_bytes)
    value = bytearray(encode_value(FP, h, [rec]))
    assert bytes(verify_value(bytes(value), FP, h, ROOT_HASH)) == rec
    offset = data.draw(st.integers(0, len(value) - 1), label="offset")
    value[offset] ^= data.draw(st.integers(1, 255), label="xor")
    with pytest.raises(VerifyError):
        verify_value(bytes(value), FP, h, ROOT_HASH)


# ------------------------------------------------------------- fingerprints and keys
def test_fingerprint_golden_value_and_equal_for_equal_layouts():
    assert namespace_fingerprint(LAYOUT).hex() == LAYOUT_FP_HEX
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(LAYOUT), type=Layout)
    assert namespace_fingerprint(decoded) == FP
    assert namespace_fingerprint(Layout(*msgspec.structs.astuple(LAYOUT))) == FP


def test_fingerprint_is_the_same_in_another_process():
    code = ("from lmcached.wire.protocol import Layout; "
            "from lmcached.daemon.spill.envelope import namespace_fingerprint; "
            f"print(namespace_fingerprint(Layout{msgspec.structs.astuple(LAYOUT)!r}).hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "12345"})
    assert out.stdout.strip() == LAYOUT_FP_HEX


CHANGED_FIELDS = {"model_name": "demo-model-v2", "world_size": 4, "worker_id": 0,
                  "fmt": "huggingface", "dtype": "float16", "num_layers": 5, "num_kv_heads": 1,
                  "head_size": 128, "chunk_size": 255, "record_bytes": (1 << 20) + 1}


def test_every_layout_field_is_in_the_fingerprint():
    assert set(CHANGED_FIELDS) == set(Layout.__struct_fields__), "a new field needs a case"
    fingerprints = {FP}
    for field, value in CHANGED_FIELDS.items():
        fp = namespace_fingerprint(msgspec.structs.replace(LAYOUT, **{field: value}))
        assert fp != FP, f"changing {field} must change the fingerprint"
        fingerprints.add(fp)
    assert len(fingerprints) == len(CHANGED_FIELDS) + 1


def test_fingerprint_refuses_what_is_not_a_wire_layout():
    with pytest.raises(TypeError, match="to_wire"):
        namespace_fingerprint(msgspec.structs.asdict(LAYOUT))


def test_key_golden_value():
    fp, chunk_hash = bytes(range(16)), bytes(range(16, 32))
    assert l2_key(fp, chunk_hash) == (b"lmcached:v1:000102030405060708090a0b0c0d0e0f:"
                                      b"101112131415161718191a1b1c1d1e1f")
    assert l2_key(fp, chunk_hash, prefix="test") == (b"test:000102030405060708090a0b0c0d0e0f:"
                                                    b"101112131415161718191a1b1c1d1e1f")


@pytest.mark.parametrize("fp, chunk_hash", [(b"x" * 15, b"y" * 16), (b"x" * 16, b"y" * 17),
                                            ("x" * 16, b"y" * 16)])
def test_keys_and_values_refuse_hashes_that_are_not_16_bytes(fp, chunk_hash):
    with pytest.raises(ValueError, match="16 bytes"):
        l2_key(fp, chunk_hash)
    with pytest.raises(ValueError, match="16 bytes"):
        encode_value(fp, chunk_hash, [b""])
