"""An arena's size limits: the floor of its block size, the ceiling of its block count.

Why this file exists: the settings (`--capacity`, `--block-size`, lmcached/settings.py)
and the daemon (the block size a first layout sets) both apply these limits: an arena
holds at least one MIN_BLOCK_BYTES block after its header, and is never cut into more
than MAX_NUM_BLOCKS blocks (`min_block_bytes`), so that the daemon's per-block metadata
and every request that walks the cached values stay bounded (docs/architecture.md,
"Block size"). Plain numbers, no import: the CLI reads them without mapping anything.
"""

MIN_BLOCK_BYTES = 4096  # one page: the smallest block a size derived from a layout takes
MAX_NUM_BLOCKS = 1 << 18  # most blocks in one arena: 4x MAX_CHUNKS_PER_REQUEST


def min_block_bytes(capacity_bytes: int) -> int:
    """The smallest block size (a multiple of 64 bytes) that cuts an arena of
    `capacity_bytes` into at most MAX_NUM_BLOCKS blocks: 64 bytes up to a 16 MiB arena,
    4 KiB for 1 GiB, 256 KiB for 64 GiB."""
    return max(64, -(-capacity_bytes // (MAX_NUM_BLOCKS * 64)) * 64)
