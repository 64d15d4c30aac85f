"""lmcached.config: sizes, byte formatting, socket path resolution, option precedence."""

import os
import re
import types

import psutil
import pytest
from click.testing import CliRunner

from lmcached import config
from lmcached.wire import envs
from lmcached.config import DEFAULT_SHM_MODE, default_socket_path, load_config
from lmcached.wire.frames import encode_frame, reply_decoder
from lmcached.wire.protocol import InfoReply
from lmcached.shm.arena import HEADER_BYTES
from lmcached.shm.geometry import MAX_NUM_BLOCKS, MIN_BLOCK_BYTES, min_block_bytes
from lmcached.sizes import parse_size
from lmcached.wire.units import echo_size, format_bytes, format_size, size_style

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


# -------------------------------------------------- sizes in the units the user typed
@pytest.mark.parametrize(("text", "style"), [
    ("10TB", "decimal"), ("4gb", "decimal"), ("512k", "decimal"), ("1.5 MB", "decimal"),
    ("10TiB", "binary"), ("8GiB", "binary"), ("1048576", "binary"), ("100b", "binary"),
    ("25%", "binary"), (4096, "binary"), (None, "binary"),
])
def test_size_style_is_decimal_only_for_decimal_units(text, style):
    assert size_style(text) == style


@pytest.mark.parametrize(("num_bytes", "binary", "decimal"), [
    (0, "0B", "0B"),
    (1000, "1000B", "1KB"),
    (1024, "1KiB", "1.02KB"),
    (512 * MiB, "512MiB", "536.87MB"),
    (25_280_000_000, "23.54GiB", "25.28GB"),
    (10**13, "9.09TiB", "10TB"),
])
def test_format_size_writes_each_style_in_a_form_parse_size_reads(num_bytes, binary, decimal):
    assert (format_size(num_bytes, "binary"), format_size(num_bytes, "decimal")) == (
        binary, decimal)
    for text in (binary, decimal):
        if num_bytes:
            assert parse_size(text) == pytest.approx(num_bytes, rel=0.005)


def test_format_size_refuses_an_unknown_style():
    with pytest.raises(ValueError, match="use 'binary' or 'decimal'"):
        format_size(1, "metric")


@pytest.mark.parametrize(("text", "num_bytes", "echo"), [
    ("10TB", 10**13, "10TB"), (" 8GiB ", 8 * GiB, "8GiB"), ("1048576", MiB, "1048576 bytes"),
    (4096, 4096, "4096 bytes"), ("50%", 8 * GiB, "50% of RAM (8GiB)"), (None, 4 * GiB, "4GiB"),
])
def test_echo_size_names_a_size_as_typed(text, num_bytes, echo):
    assert echo_size(text, num_bytes) == echo


@pytest.mark.parametrize(("source", "capacity", "free_bytes", "message"), [
    ("option", "10TB", 25_280_000_000,
     r"^capacity 10TB \(--capacity\) is more than /dev/shm has free \(25\.28GB\); ask for "
     r"less, or enlarge /dev/shm$"),
    ("option", "100GiB", 25_275_882_536,
     r"^capacity 100GiB \(--capacity\) is more than /dev/shm has free \(23\.54GiB\)"),
    ("env", "30GB", 25_280_000_000,
     r"^capacity 30GB \(LMCACHED_CAPACITY\) is more than /dev/shm has free \(25\.28GB\)"),
    ("file", '"2TB"', 10**12,
     r"^capacity 2TB \(capacity in \S+/c\.toml\) is more than /dev/shm has free \(1TB\)"),
    ("file", "3000000000", GiB,
     r"^capacity 3000000000 bytes \(capacity in \S+/c\.toml\) is more than /dev/shm has "
     r"free \(1GiB\)"),
])
def test_capacity_beyond_dev_shm_is_refused_in_the_units_typed(clean_env, tmp_path, source,
                                                               capacity, free_bytes, message):
    clean_env.setattr(config, "shm_free_bytes", lambda: free_bytes)
    options, path = {}, None
    if source == "option":
        options["capacity"] = capacity
    elif source == "env":
        clean_env.setenv("LMCACHED_CAPACITY", capacity)
    else:
        path = write_toml(tmp_path / "c.toml", f"capacity = {capacity}\n")
    with pytest.raises(ValueError, match=message):
        load_config(options, path)


@pytest.mark.parametrize(("capacity", "echo"), [("4KB", "4KB"), ("4097", "4097 bytes"),
                                                ("8191", "8191 bytes")])
def test_a_capacity_that_holds_no_block_is_refused(clean_env, tmp_path, capacity, echo):
    """The header and one smallest block: `--capacity 4097` (1 usable byte) used to be
    accepted while `--capacity 1` was refused."""
    with pytest.raises(ValueError, match=rf"^--capacity: capacity {echo} leaves no room for a "
                       r"block: the arena needs at least 8192 bytes \(its 4096-byte header "
                       r"and one 4096-byte block\)$"):
        load_config({"capacity": capacity})
    assert load_config({"capacity": "8192"}).capacity_bytes == HEADER_BYTES + MIN_BLOCK_BYTES
    path = write_toml(tmp_path / "c.toml", 'capacity = "1MiB"\nblock_size = "2MiB"\n')
    with pytest.raises(ValueError, match=r"^block size 2MiB \(block_size in \S+/c.toml\) does "
                       r"not fit in capacity 1MiB \(capacity in \S+/c.toml\) with the arena's "
                       r"4096-byte header; use a smaller block size or a larger capacity$"):
        load_config({}, path)
    assert load_config({"block_size": str(MiB - 4096)}, path).block_bytes == MiB - 4096


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
    # The documented default capacity: 4 GiB, and at most 25% of RAM.
    assert cfg.capacity_bytes == min(4 * GiB, psutil.virtual_memory().total // 4)
    assert cfg.block_bytes == 0 and cfg.shm_mode == DEFAULT_SHM_MODE == 0o600
    assert cfg.log_level == "INFO" and cfg.allow_group is None and cfg.config_file is None


@pytest.mark.parametrize(
    ("ram_bytes", "expected"),
    [
        (2 * GiB, 512 * MiB),  # 25% of a small machine
        (10 * GiB + 4, 10 * GiB // 4 + 1),
        (16 * GiB, 4 * GiB),  # 25% is exactly 4 GiB
        (16 * GiB + 4, 4 * GiB),
        (1 << 40, 4 * GiB),  # 4 GiB on a large one
    ],
)
def test_default_capacity_is_4gib_and_at_most_a_quarter_of_ram(clean_env, ram_bytes, expected):
    clean_env.setattr(config, "shm_free_bytes", lambda: 1 << 50)
    clean_env.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(total=ram_bytes))
    assert load_config({}).capacity_bytes == expected


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


def test_missing_config_file_is_refused_naming_its_source(clean_env, tmp_path):
    path = str(tmp_path / "absent.toml")
    with pytest.raises(ValueError, match=r"^--config: cannot read .*absent.toml: No such file"):
        load_config({}, path)
    clean_env.setenv("LMCACHED_CONFIG", path)
    with pytest.raises(ValueError, match=r"^LMCACHED_CONFIG: cannot read .*absent.toml"):
        load_config({})


def test_options_that_are_not_settings_are_refused(clean_env):
    with pytest.raises(ValueError, match=r"unknown settings \['capcity'\]; use \["):
        load_config({"capcity": "1MiB"})


def test_capacity_beyond_dev_shm_free_is_refused(clean_env):
    with pytest.raises(ValueError, match=r"^capacity 100TiB \(--capacity\) is more than /dev/shm "
                       r"has free \([0-9.]+([KMGT]i)?B\)"):
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
         r"^--block-size: block size 100 bytes is not a multiple of 64 bytes$"),
        ({"capacity": "1MiB"}, {}, "block_size = 1000\n",
         r"^block_size in .*c.toml: block size 1000 bytes is not a multiple of 64 bytes$"),
        ({"capacity": "1MiB", "block_size": "1000B"}, {}, "",
         r"^--block-size: block size 1000B is not a multiple of 64 bytes$"),
        ({"capacity": "1MiB", "metrics_port": "0"}, {}, "",
         r"^--metrics-port: invalid value '0': Expected `int` >= 1; expected a TCP port"),
        ({"capacity": "1MiB"}, {"LMCACHED_METRICS_PORT": "http"}, "",
         r"^LMCACHED_METRICS_PORT: invalid value 'http': Expected `int`, got `str`"),
        ({"capacity": "1MiB"}, {}, "metrics_port = 65536\n",
         r"^metrics_port in .*c.toml: invalid value 65536: Expected `int` <= 65535"),
        ({"capacity": "1MiB"}, {}, 'metrics_port = "9464"\n',
         r"^metrics_port in .*c.toml: invalid value '9464': Expected `int`, got `str`"),
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


@pytest.mark.parametrize(("capacity", "block_size", "floor_bytes"), [
    ("1GiB", "2048 bytes", 4096), ("64GiB", "128KiB", 256 << 10), ("17MiB", "64 bytes", 128),
])
def test_a_block_size_that_cuts_the_arena_into_too_many_blocks_is_refused(
        clean_env, capacity, block_size, floor_bytes):
    clean_env.setattr(config, "shm_free_bytes", lambda: 1 << 40)
    assert min_block_bytes(parse_size(capacity)) == floor_bytes
    with pytest.raises(ValueError, match=rf"^block size {block_size} \(--block-size\) cuts "
                       rf"capacity {capacity} \(--capacity\) into more than {MAX_NUM_BLOCKS} "
                       rf"blocks; use a block size of at least {floor_bytes} bytes, or a "
                       r"smaller capacity$"):
        load_config({"capacity": capacity, "block_size": block_size.removesuffix(" bytes")})
    cfg = load_config({"capacity": capacity, "block_size": floor_bytes})
    assert (cfg.capacity_bytes - HEADER_BYTES) // cfg.block_bytes <= MAX_NUM_BLOCKS


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


@pytest.mark.parametrize(
    ("source", "value", "label", "shown"),
    [
        ("option", "0777", "--shm-mode", "'0777' (0777)"),
        ("option", "0604", "--shm-mode", "'0604' (0604)"),
        ("env", "0777", "LMCACHED_SHM_MODE", "'0777' (0777)"),
        ("env", "0661", "LMCACHED_SHM_MODE", "'0661' (0661)"),
        ("file", "511", r"shm_mode in \S+/m.toml", "511 (0777)"),
        ("file", '"0666"', r"shm_mode in \S+/m.toml", "'0666' (0666)"),
        ("file", "0o640", None, None),  # no bits for others: accepted
    ],
)
def test_shm_mode_with_bits_for_others_is_refused_naming_its_source(
        clean_env, tmp_path, source, value, label, shown):
    """A world-readable or -writable arena exposes every cached prompt to every user:
    `LMCACHED_SHM_MODE=0777` and TOML `shm_mode = 511` used to be accepted silently."""
    options, path = {"capacity": "1MiB", "allow_group": "staff"}, None
    if source == "option":
        options["shm_mode"] = value
    elif source == "env":
        clean_env.setenv("LMCACHED_SHM_MODE", value)
    else:
        path = write_toml(tmp_path / "m.toml", f"shm_mode = {value}\n")
    if label is None:
        assert load_config(options, path).shm_mode == 0o640
        return
    with pytest.raises(ValueError, match=rf"^{label}: shm mode {re.escape(shown)} gives other "
                       r"users access to the arena, and so to every cached prompt.*: use 0600, "
                       r"or 0660 with --allow-group to share it with a group$"):
        load_config(options, path)


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


# ------------------------------------------------- one typed schema for every source
@pytest.mark.parametrize(
    ("file_text", "message"),
    [
        ("shm_mode = 1.0\n", r"^shm_mode in .*t.toml: invalid value 1.0: Expected `int \| str`, "
         r"got `float`; expected octal permission bits"),
        ("socket = 7\n", r"^socket in .*t.toml: invalid value 7: Expected `str`, got `int`"),
        ('max_clients = "many"\n', r"^max_clients in .*t.toml: .*Expected `int`, got `str`"),
        ('max_clients = "10"\n', r"^max_clients in .*t.toml: .*Expected `int`, got `str`"),
        ("max_clients = 0\n", r"^max_clients in .*t.toml: invalid value 0: Expected `int` >= 1"),
        ("max_clients = true\n", r"^max_clients in .*t.toml: .*got `bool`"),
        ("idle_timeout = -1\n", r"^idle_timeout in .*t.toml: .*Expected `float` >= 0"),
        ('idle_timeout = "5"\n', r"^idle_timeout in .*t.toml: .*Expected `float`, got `str`"),
        ("buffer_budget = 1.5\n", r"^buffer_budget in .*t.toml: .*got `float`"),
        ('buffer_budget = "512KiB"\n', r"^buffer_budget in .*t.toml: buffer budget 512KiB is "
         r"less than one largest frame \(1MiB\)$"),
        ('buffer_budget = "1MB"\n', r"^buffer_budget in .*t.toml: buffer budget 1MB is "
         r"less than one largest frame \(1\.05MB\)$"),
        ("capacity = 8.0\n", r"^capacity in .*t.toml: .*got `float`"),
        ("log_level = 10\n", r"^log_level in .*t.toml: .*Expected `str`, got `int`"),
        ('allow_group = ["a"]\n', r"^allow_group in .*t.toml: .*got `array`"),
        ("shm_mode = 660\n", r"^shm_mode in .*t.toml: shm mode 660 is out of range \(a TOML "
         r"integer is decimal"),
        ('name = "a/b"\n', r"^name in .*t.toml: arena name 'a/b' must be"),
        ("capacity = \n", r"t.toml is not valid TOML"),
    ],
)
def test_file_values_of_the_wrong_type_are_refused_naming_the_key(clean_env, tmp_path,
                                                                   file_text, message):
    path = write_toml(tmp_path / "t.toml", 'capacity = "1MiB"\n' * ("capacity" not in file_text)
                      + file_text)
    with pytest.raises(ValueError, match=message):
        load_config({}, path)


@pytest.mark.parametrize(
    ("options", "env", "message"),
    [
        ({}, {"LMCACHED_MAX_CLIENTS": "lots"}, r"^LMCACHED_MAX_CLIENTS: invalid value 'lots': "
         r"Expected `int`, got `str`; expected a whole number"),
        ({}, {"LMCACHED_MAX_CLIENTS": "0"}, r"^LMCACHED_MAX_CLIENTS: .*>= 1"),
        ({}, {"LMCACHED_IDLE_TIMEOUT": "soon"}, r"^LMCACHED_IDLE_TIMEOUT: invalid value 'soon'"),
        ({}, {"LMCACHED_BUFFER_BUDGET": "huge"}, r"^LMCACHED_BUFFER_BUDGET: cannot parse size"),
        ({"max_clients": "-3"}, {}, r"^--max-clients: invalid value '-3': Expected `int` >= 1"),
        ({"idle_timeout": "1m"}, {}, r"^--idle-timeout: invalid value '1m'"),
        ({"buffer_budget": "0"}, {}, r"^--buffer-budget: size must be positive"),
        ({"socket": ""}, {}, r"^--socket: invalid value '': Expected `str` of length >= 1"),
    ],
)
def test_env_and_option_values_of_the_wrong_type_are_refused_naming_the_source(
    clean_env, options, env, message
):
    for name, value in env.items():
        clean_env.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        load_config({"capacity": "1MiB", **options})


def test_limits_come_from_file_env_and_options_with_their_defaults(clean_env, tmp_path):
    cfg = load_config({"capacity": "1MiB"})
    assert (cfg.max_clients, cfg.idle_timeout_s, cfg.buffer_budget_bytes) == (1024, 0.0, 128 * MiB)
    path = write_toml(tmp_path / "l.toml",
                      'max_clients = 7\nidle_timeout = 2\nbuffer_budget = "64MiB"\n')
    cfg = load_config({"capacity": "1MiB"}, path)
    assert (cfg.max_clients, cfg.idle_timeout_s, cfg.buffer_budget_bytes) == (7, 2.0, 64 * MiB)
    assert type(cfg.idle_timeout_s) is float
    clean_env.setenv("LMCACHED_MAX_CLIENTS", "9")
    clean_env.setenv("LMCACHED_IDLE_TIMEOUT", "0.5")
    clean_env.setenv("LMCACHED_BUFFER_BUDGET", "2MiB")
    cfg = load_config({"capacity": "1MiB"}, path)
    assert (cfg.max_clients, cfg.idle_timeout_s, cfg.buffer_budget_bytes) == (9, 0.5, 2 * MiB)
    cfg = load_config({"capacity": "1MiB", "max_clients": "11", "idle_timeout": "30",
                       "buffer_budget": "1GiB"}, path)
    assert (cfg.max_clients, cfg.idle_timeout_s, cfg.buffer_budget_bytes) == (11, 30.0, GiB)
    fields = cfg.as_dict()
    assert (fields["max_clients"], fields["idle_timeout_s"], fields["buffer_budget_bytes"]) == (
        11, 30.0, GiB)


def test_session_limits_default_to_half_the_arena_and_60_s_and_refuse_out_of_range(
        clean_env, tmp_path):
    cfg = load_config({"capacity": "1MiB"})
    assert (cfg.max_session_share, cfg.writing_timeout_s) == (50.0, 60.0)
    path = write_toml(tmp_path / "s.toml", "max_session_share = 100\nwriting_timeout = 0\n")
    cfg = load_config({"capacity": "1MiB"}, path)
    assert (cfg.max_session_share, cfg.writing_timeout_s) == (100.0, 0.0)
    for value in ("0", "101", "-5"):
        with pytest.raises(ValueError, match=r"^--max-session-share: invalid value .*"
                           "expected a percentage of the arena's blocks"):
            load_config({"capacity": "1MiB", "max_session_share": value})
    with pytest.raises(ValueError, match=r"^--writing-timeout: invalid value '-1'"):
        load_config({"capacity": "1MiB", "writing_timeout": "-1"})


# For each setting: a valid value of its LMCACHED_* variable that is not the default, the
# ServerConfig field it sets, and the effective value expected there.
ENV_SETTINGS = {
    "name": ("from-env", "name", "from-env"),
    "socket": ("/run/from-env/d.sock", "socket", "/run/from-env/d.sock"),
    "capacity": ("16MiB", "capacity_bytes", 16 * MiB),
    "block_size": ("64KiB", "block_bytes", 65536),
    "shm_mode": ("0640", "shm_mode", 0o640),
    "log_level": ("error", "log_level", "ERROR"),
    "allow_group": ("staff", "allow_group", "staff"),
    "max_clients": ("9", "max_clients", 9),
    "events_capacity": ("128", "events_capacity", 128),
    "idle_timeout": ("2.5", "idle_timeout_s", 2.5),
    "max_session_share": ("25", "max_session_share", 25.0),
    "writing_timeout": ("5.5", "writing_timeout_s", 5.5),
    "buffer_budget": ("2MiB", "buffer_budget_bytes", 2 * MiB),
    "metrics_port": ("9464", "metrics_port", 9464),
    "metrics_host": ("::1", "metrics_host", "::1"),
    "l2": ("redis://10.0.0.5:6379,10.0.0.6:6379", "l2_url", "redis://10.0.0.5:6379,10.0.0.6:6379"),
    "l2_policy": ("on-evict", "l2_policy", "on-evict"),
    "l2_ttl": ("3600", "l2_ttl_s", 3600.0),
    "l2_queue": ("64MiB", "l2_queue_bytes", 64 * MiB),
    "l2_fetch_wait": ("0.05", "l2_fetch_wait_s", 0.05),
    "l2_threads": ("4", "l2_threads", 4),
    "disk_path": ("/var/cache/from-env", "disk_path", "/var/cache/from-env"),
    "disk_capacity": ("2GiB", "disk_capacity", str(2 << 30)),
    "disk_policy": ("write-through", "disk_policy", "write-through"),
    "disk_fetch_wait": ("0.5", "disk_fetch_wait_s", 0.5),
    "disk_save_on_stop": ("2.5", "disk_save_on_stop_s", 2.5),
    "gpu_capacity": ("2GiB", "gpu_capacity_bytes", 2 << 30),
    "gpu_device": ("1,2", "gpu_devices", (1, 2)),
    "gpu_backend": ("fake", "gpu_backend", "fake"),
}
# Settings that are refused without another one: that one is set for each invocation.
ENV_REQUIRES = {"gpu_device": ["--gpu-capacity", "1GiB"]}


@pytest.fixture
def served(clean_env):
    """`lmcached serve` with the daemon left out: the ServerConfigs it would have run."""
    configs = []
    clean_env.setattr("lmcached.daemon.server.run_server", lambda cfg: configs.append(cfg) or 0)
    clean_env.setattr("lmcached.cli.configure_logging", lambda level: None)
    clean_env.setattr(config, "shm_free_bytes", lambda: 1 << 50)
    return configs


@pytest.mark.parametrize("key", config.Settings.__struct_fields__)
def test_every_setting_is_read_from_its_env_variable_and_its_serve_option(served, key):
    from lmcached.cli import main

    env_value, field, expected = ENV_SETTINGS[key]  # a KeyError: add the new setting above
    variable = f"LMCACHED_{key.upper()}"
    assert variable in envs.ENV_VARS, f"document {variable} in lmcached/wire/envs.py"
    required = ENV_REQUIRES.get(key, [])
    result = CliRunner().invoke(main, ["serve", *required])
    assert result.exit_code == 0, result.output
    assert getattr(served.pop(), field) != expected  # the value is not the default
    result = CliRunner(env={variable: env_value}).invoke(main, ["serve", *required])
    assert result.exit_code == 0, result.output
    assert getattr(served.pop(), field) == expected
    result = CliRunner().invoke(main, ["serve", *required, f"--{key.replace('_', '-')}",
                                       env_value])
    assert result.exit_code == 0, result.output
    assert getattr(served.pop(), field) == expected


def test_metrics_are_off_unless_a_port_is_given_in_any_source(clean_env, tmp_path):
    cfg = load_config({"capacity": "1MiB"})
    assert (cfg.metrics_port, cfg.metrics_host) == (None, "127.0.0.1")
    assert (cfg.as_dict()["metrics_port"], cfg.as_dict()["metrics_host"]) == ("", "127.0.0.1")
    path = write_toml(tmp_path / "m.toml", 'metrics_port = 9464\nmetrics_host = "0.0.0.0"\n')
    cfg = load_config({"capacity": "1MiB"}, path)
    assert (cfg.metrics_port, cfg.metrics_host) == (9464, "0.0.0.0")
    clean_env.setenv("LMCACHED_METRICS_PORT", "9465")
    assert load_config({"capacity": "1MiB"}, path).metrics_port == 9465
    assert load_config({"capacity": "1MiB", "metrics_port": "9466"}, path).metrics_port == 9466


def test_allow_group_makes_the_arena_0660_unless_shm_mode_is_given(clean_env):
    cfg = load_config({"capacity": "1MiB", "allow_group": "staff"})
    assert cfg.shm_mode == 0o660
    cfg = load_config({"capacity": "1MiB", "allow_group": "staff", "shm_mode": "0600"})
    assert cfg.shm_mode == 0o600


def test_relative_socket_is_made_absolute(clean_env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config({"capacity": "1MiB", "socket": "d.sock"}).socket == str(tmp_path / "d.sock")


def test_serve_reports_a_toml_type_error_and_starts_nothing(clean_env, tmp_path, unique_name):
    from click.testing import CliRunner

    from lmcached.cli import main

    path = write_toml(tmp_path / "bad.toml", "socket = 7\n")
    result = CliRunner().invoke(main, ["serve", "--config", path, "--name", unique_name,
                                       "--capacity", "1MiB"])
    assert result.exit_code == 1
    assert "socket in " in result.output and "Expected `str`, got `int`" in result.output
    assert not os.path.exists("7")


def test_l2_without_redis_py_is_refused_naming_the_extra(clean_env, monkeypatch):
    import sys

    for name in [m for m in sys.modules if m == "redis" or m.startswith(("redis.", "lmcached.daemon.l2"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "redis", None)  # import redis -> ImportError
    with pytest.raises(config.ConfigError, match=r"--l2: the L2 tier needs redis-py .*"
                       r"pip install '\.\[l2\]' in a checkout of lmcached, or "
                       r"pip install 'lmcached\[l2\]' from a package index"):
        load_config({"l2": "redis://127.0.0.1:6379"}, check_shm_free=False)


@pytest.mark.parametrize("url", ["127.0.0.1:6379", "redis://", "redis://host", "http://h:1"])
def test_a_malformed_l2_url_is_refused_naming_its_source(clean_env, url):
    with pytest.raises(config.ConfigError, match=r"^--l2: "):
        load_config({"l2": url}, check_shm_free=False)
