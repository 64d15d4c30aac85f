"""What vLLM does with a chunk the connector could not load: recompute it, or fail the request.

Why this file exists: lmcached is a best-effort cache, so its default is vLLM's
`kv_load_failure_policy="recompute"` (a chunk that cannot be loaded, because the daemon is
gone, the arena was replaced or a record does not match, is computed again and the request
goes on). A deployment that alerts on failed requests may want such a load to fail its
request instead; that choice is the user's and is kept.

vLLM 0.32 declares "fail" as the field's default, so a `KVTransferConfig` holding "fail"
cannot say whether the user wrote it. The choice is therefore explicit when
`kv_connector_extra_config` names it (`{"kv_load_failure_policy": "fail"}`, read by this
connector only), or when the top-level field holds a value other than vLLM's declared
default (a release whose default is "recompute", where a "fail" can only be the user's).
"""

import dataclasses

from lmcached.wire.logger import init_logger

logger = init_logger(__name__)

POLICIES = ("recompute", "fail")
EXTRA_KEY = "kv_load_failure_policy"


def _declared_default(transfer) -> str | None:
    """vLLM's default for `kv_load_failure_policy` (None if this release declares none)."""
    for field in dataclasses.fields(type(transfer)):
        if field.name == "kv_load_failure_policy":
            return field.default if field.default is not dataclasses.MISSING else None
    return None


def apply_load_failure_policy(transfer) -> str:
    """Set `transfer.kv_load_failure_policy` to the policy the connector runs under.

    "recompute" unless the user chose "fail" explicitly (see the module docstring); an
    explicit "fail" is kept and logged as a WARNING that says what it means. vLLM's
    scheduler reads the field after it built the connector, so this must run in the
    connector's `__init__`.

    Args:
        transfer: vLLM's KVTransferConfig (changed in place).

    Returns:
        "recompute" or "fail".

    Raises:
        ValueError: `kv_connector_extra_config["kv_load_failure_policy"]` is neither
            "recompute" nor "fail".
    """
    given = transfer.kv_load_failure_policy
    extra = transfer.get_from_extra_config(EXTRA_KEY, None)
    if extra is not None and extra not in POLICIES:
        raise ValueError(f"kv_connector_extra_config {EXTRA_KEY}={extra!r}: use one of "
                         f"{', '.join(repr(p) for p in POLICIES)}")
    if extra is not None:
        policy = extra
    elif given != _declared_default(transfer):
        policy = given  # differs from vLLM's default: the user's own choice
    else:
        policy = "recompute"
        if given != policy:
            logger.info("lmcached: kv_load_failure_policy %r (vLLM's default) -> 'recompute': "
                        "a chunk that cannot be loaded is computed again. To fail its request "
                        "instead, put \"%s\": \"fail\" in kv_connector_extra_config",
                        given, EXTRA_KEY)
    if policy == "fail":
        logger.warning("lmcached: kv_load_failure_policy 'fail' (as configured): a chunk the "
                       "cache cannot load (daemon gone, arena replaced, record mismatch) "
                       "finishes its request with an error instead of being recomputed")
    transfer.kv_load_failure_policy = policy
    return policy
