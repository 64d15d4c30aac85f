"""lmcached.config: sizes, byte formatting, socket path resolution, option precedence."""

import os

import pytest

from lmcached import config, envs
from lmcached.config import (
    DEFAULT_SHM_MODE,
    default_socket_path,
    format_bytes,
    load_config,
    parse_size,
)
from lmcached.protocol import InfoReply, encode_frame, reply_decoder

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture
def clean_env(monkeypatch):
    """No LMCACHED_* or systemd variable from the caller's environment leaks in."""
    for name in (*envs.ENV_VARS, *envs.SYSTEMD_VARS, "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def write_toml(path, text: str) -> str:
    path.write_text(text)
    return str(path)


# ------------------------------------------------------------------------ parse_size
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 * MiB),
        ("8GiB", 8 * GiB),
        ("4GB", 4 * 10**9),
        ("1048576", 1048576),
        ("64kib", 64 * 1024),
        (" 2 MiB ", 2 * MiB),
        ("1.5GiB", 3 * GiB // 2),
        ("100b", 100),
        (4096, 4096),
    ],
)
def test_parse_size_accepts_bytes_binary_and_decimal_units(text, expected):
    assert parse_size(text) == expected


def test_parse_size_percentage_is_of_total_bytes():
    assert parse_size("25%", total_bytes=1000) == 250
    assert parse_size("100%", total_bytes=1000) == 1000
    assert parse_size("12.5%", total_bytes=8 * GiB) == GiB


@pytest.mark.parametrize("text", ["lots", "12 parsecs", "-5MiB", "", "5 MiB extra", "0x10"])
def test_parse_size_refuses_garbage_with_the_accepted_forms(text):
    with pytest.raises(ValueError, match=r"cannot parse size .*512MiB, 8GiB, 4GB or 25%"):
        parse_size(text)


def test_parse_size_refuses_a_percentage_that_is_not_a_number():
    with pytest.raises(ValueError, match=r"cannot parse percentage 'half%'.*25%"):
        parse_size("half%", total_bytes=1000)


@pytest.mark.parametrize("text", [0, "0", "0MiB", "0.0001B"])
def test_parse_size_refuses_zero(text):
    with pytest.raises(ValueError, match="must be positive"):
        parse_size(text)


@pytest.mark.parametrize("text", ["150%", "0%", "-5%", "100.5%"])
def test_parse_size_refuses_percentages_outside_0_to_100(text):
    with pytest.raises(ValueError, match=r"must be in \(0, 100\]"):
        parse_size(text, total_bytes=1000)


@pytest.mark.parametrize("value", [1.5e9, True, None])
def test_parse_size_refuses_values_that_are_neither_text_nor_whole_bytes(value):
    with pytest.raises(ValueError, match="must be a string"):
        parse_size(value)


# ---------------------------------------------------------------------- format_bytes
@pytest.mark.parametrize(
    ("num_bytes", "expected"),
    [
        (0, "0B"),
        (12, "12B"),
        (1023, "1023B"),
        (1024, "1.00K"),
        (1536, "1.50K"),
        (512 * MiB, "512.00M"),
        (3 * GiB // 2, "1.50G"),
        (2 << 40, "2.00T"),
    ],
)
def test_format_bytes_is_redis_style(num_bytes, expected):
    assert format_bytes(num_bytes) == expected


# --------------------------------------------------------------- default_socket_path
def test_socket_path_prefers_lmcached_socket(clean_env):
    clean_env.setenv("LMCACHED_SOCKET", "/srv/cache.sock")
    clean_env.setenv("RUNTIME_DIRECTORY", "/run/lmcached")
    clean_env.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert default_socket_path("llama") == "/srv/cache.sock"


def test_socket_path_under_systemd_uses_runtime_directory(clean_env):
    clean_env.setenv("RUNTIME_DIRECTORY", "/run/lmcached")
    clean_env.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert default_socket_path("default") == "/run/lmcached/lmcached.sock"
    assert default_socket_path("llama") == "/run/lmcached/llama.sock"


def test_socket_path_takes_the_first_of_several_runtime_directories(clean_env):
    clean_env.setenv("RUNTIME_DIRECTORY", "/run/lmcached:/run/other")
    assert default_socket_path("llama") == "/run/lmcached/llama.sock"


def test_socket_path_falls_back_to_xdg_runtime_dir(clean_env):
    clean_env.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert default_socket_path("default") == "/run/user/1000/lmcached/default.sock"
    assert default_socket_path("llama") == "/run/user/1000/lmcached/llama.sock"


def test_socket_path_falls_back_to_a_per_uid_tmp_directory(clean_env):
    assert default_socket_path("llama") == f"/tmp/lmcached-{os.getuid()}/llama.sock"


# ----------------------------------------------------------------------- load_config
def test_defaults_without_options_env_or_file(clean_env):
    clean_env.setattr(config, "shm_free_bytes", lambda: 1 << 50)
    cfg = load_config({})
    assert cfg.name == "default"
    assert cfg.socket == f"/tmp/lmcached-{os.getuid()}/default.sock"
    assert cfg.capacity_bytes == config.default_capacity_bytes()
    assert cfg.capacity_bytes <= 4 * GiB
    assert cfg.block_bytes == 0 and cfg.shm_mode == DEFAULT_SHM_MODE == 0o600
    assert cfg.log_level == "INFO" and cfg.allow_group is None and cfg.config_file is None


def test_precedence_is_option_then_env_then_file_then_default(clean_env, tmp_path):
    path = write_toml(
        tmp_path / "lmcached.toml",
        'capacity = "8MiB"\nlog_level = "warning"\nname = "from-file"\nblock_size = 4096\n',
    )
    cfg = load_config({}, path)
    assert (cfg.capacity_bytes, cfg.log_level, cfg.name) == (8 * MiB, "WARNING", "from-file")
    assert cfg.block_bytes == 4096 and cfg.config_file == path
    assert cfg.shm_mode == DEFAULT_SHM_MODE  # not in any source: the default

    clean_env.setenv("LMCACHED_CAPACITY", "16MiB")
    clean_env.setenv("LMCACHED_LOG_LEVEL", "error")
    cfg = load_config({}, path)
    assert (cfg.capacity_bytes, cfg.log_level, cfg.name) == (16 * MiB, "ERROR", "from-file")

    cfg = load_config({"capacity": "32MiB", "log_level": None, "name": "cli"}, path)
    assert (cfg.capacity_bytes, cfg.log_level, cfg.name) == (32 * MiB, "ERROR", "cli")


def test_config_file_comes_from_lmcached_config_when_not_given(clean_env, tmp_path):
    path = write_toml(tmp_path / "env.toml", 'capacity = "2MiB"\n')
    clean_env.setenv("LMCACHED_CONFIG", path)
    cfg = load_config({})
    assert cfg.capacity_bytes == 2 * MiB and cfg.config_file == path


def test_name_sets_the_default_socket(clean_env, tmp_path):
    clean_env.setenv("RUNTIME_DIRECTORY", str(tmp_path))
    cfg = load_config({"name": "llama", "capacity": "1MiB"})
    assert cfg.socket == str(tmp_path / "llama.sock")
    cfg = load_config({"name": "llama", "capacity": "1MiB", "socket": "/x/y.sock"})
    assert cfg.socket == "/x/y.sock"


def test_unknown_key_in_file_is_refused_with_the_known_keys(clean_env, tmp_path):
    path = write_toml(tmp_path / "bad.toml", 'capacity = "8MiB"\ncapcity = "9MiB"\n')
    with pytest.raises(ValueError, match=r"unknown keys in .*bad.toml: \['capcity'\]; known:"):
        load_config({}, path)


def test_missing_config_file_raises_file_not_found(clean_env, tmp_path):
    with pytest.raises(FileNotFoundError):
        load_config({}, str(tmp_path / "absent.toml"))


def test_capacity_beyond_dev_shm_free_is_refused(clean_env):
    with pytest.raises(ValueError, match=r"100.00T \(--capacity\) is more than /dev/shm has free"):
        load_config({"capacity": "100TiB"})


def test_capacity_check_can_be_skipped_by_a_running_daemon(clean_env):
    """SIGHUP re-reads the file while the daemon's own arena fills /dev/shm."""
    clean_env.setattr(config, "shm_free_bytes", lambda: MiB)
    with pytest.raises(ValueError, match="/dev/shm"):
        load_config({"capacity": "64MiB"})
    assert load_config({"capacity": "64MiB"}, check_shm_free=False).capacity_bytes == 64 * MiB


@pytest.mark.parametrize(
    ("options", "env", "file_text", "message"),
    [
        ({"capacity": "lots"}, {}, "", r"^--capacity: cannot parse size 'lots'"),
        ({}, {"LMCACHED_CAPACITY": "150%"}, "", r"^LMCACHED_CAPACITY: percentage"),
        ({}, {}, 'capacity = "0"\n', r"^capacity in .*c.toml: size must be positive"),
        ({"capacity": "1MiB", "block_size": "100"}, {}, "",
         r"^--block-size: block size 100 is not a multiple of 64"),
        ({"capacity": "1MiB"}, {}, "block_size = 1000\n",
         r"^block_size in .*c.toml: block size 1000 is not a multiple of 64"),
        ({"capacity": "1MiB", "shm_mode": "0689"}, {}, "",
         r"^--shm-mode: shm mode '0689' is not octal"),
        ({"capacity": "1MiB", "shm_mode": "1777"}, {}, "", r"shm mode '1777' is out of range"),
        ({"capacity": "1MiB"}, {"LMCACHED_LOG_LEVEL": "chatty"}, "",
         r"^LMCACHED_LOG_LEVEL: unknown log level 'chatty'"),
    ],
)
def test_bad_values_are_refused_naming_their_source(
    clean_env, tmp_path, options, env, file_text, message
):
    path = write_toml(tmp_path / "c.toml", file_text)
    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        load_config(options, path)


@pytest.mark.parametrize("block_size", ["64", "4096", "1MiB", 2 * MiB])
def test_block_size_multiple_of_64_is_accepted(clean_env, block_size):
    cfg = load_config({"capacity": "4MiB", "block_size": block_size})
    assert cfg.block_bytes == parse_size(block_size) and cfg.block_bytes % 64 == 0


@pytest.mark.parametrize(
    ("source", "value", "expected"),
    [
        ("option", "0660", 0o660),
        ("option", "640", 0o640),
        ("env", "0600", 0o600),
        ("file", '"0660"', 0o660),
        ("file", "0o640", 0o640),  # a TOML integer written in octal
    ],
)
def test_shm_mode_is_octal(clean_env, tmp_path, source, value, expected):
    options = {"capacity": "1MiB"}
    path = None
    if source == "option":
        options["shm_mode"] = value
    elif source == "env":
        clean_env.setenv("LMCACHED_SHM_MODE", value)
    else:
        path = write_toml(tmp_path / "m.toml", f"shm_mode = {value}\n")
    cfg = load_config(options, path)
    assert cfg.shm_mode == expected
    assert cfg.as_dict()["shm_mode"] == f"0{expected:o}"


def test_as_dict_is_flat_with_empty_strings_for_unset_values(clean_env):
    cfg = load_config({"capacity": "1MiB", "socket": "/x.sock"})
    fields = cfg.as_dict()
    assert fields["capacity_bytes"] == MiB and fields["socket"] == "/x.sock"
    assert fields["allow_group"] == "" and fields["config_file"] == ""
    assert fields["shm_mode"] == "0600"
    assert fields["prefault"] == 1 and type(fields["prefault"]) is int


def test_as_dict_survives_the_config_get_reply(clean_env):
    """CONFIG GET sends as_dict() in an InfoReply, whose values are int | float | str."""
    fields = load_config({"capacity": "1MiB"}).as_dict()
    frame = encode_frame(InfoReply({"config": fields}))
    assert reply_decoder.decode(frame[4:]).sections == {"config": fields}
