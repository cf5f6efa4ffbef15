"""Mount options from a TOML file, TIERFS_* variables and flags, with precedence, and the
checks every value gets wherever it comes from."""
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tierfs.cold import check_s3_environment
from tierfs.config import OPTIONS, build_config, known_env, parse_size, unknown_env_warnings
from tierfs.errors import ColdConfigError, UserError
from tierfs.tier.space import Space, check_cache_size

GiB = 1 << 30
MiB = 1 << 20
REQUIRED = {"cold_url": "file:///x", "mountpoint": "/m", "cache_dir": "/c"}
REPO = Path(__file__).resolve().parents[2]


def test_sizes_accept_units():
    assert parse_size("4096") == 4096
    assert parse_size("64M") == 64 << 20
    assert parse_size("200G") == 200 << 30
    assert parse_size("1.5T") == int(1.5 * (1 << 40))
    assert parse_size("8MiB") == 8 << 20
    assert parse_size("2P") == 2 << 50
    assert parse_size("0.5K") == 512
    assert parse_size("1.0") == 1
    with pytest.raises(UserError, match="is not a size"):
        parse_size("lots")


@pytest.mark.parametrize("text,message", [
    ("0.5", "is not a whole number of bytes .*add a unit, e.g. 0.5G"),
    ("1.5", "is not a whole number of bytes"),
    ("0.0000001K", "is less than one byte"),
    ("-5G", "must be ≥ 0"),
    ("-1", "must be ≥ 0"),
])
def test_sizes_refuse_fractions_of_a_byte_and_negatives(text, message):
    with pytest.raises(UserError, match=message):
        parse_size(text)


def test_precedence_flag_over_env_over_file(tmp_path):
    conf = tmp_path / "t.toml"
    conf.write_text('cold_url = "file:///tmp/c"\nmountpoint = "/mnt/x"\ncache-dir = "/c"\n'
                    'cache_size = "10G"\nupload_delay = 3\nwriteback_cache = false\n'
                    'min_free = "2G"\n')
    env = {"TIERFS_CACHE_SIZE": "20G", "TIERFS_UPLOAD_DELAY": "7"}
    cfg = build_config({"upload_delay": "9"}, str(conf), env)
    assert cfg.cold_url == "file:///tmp/c" and cfg.mountpoint == "/mnt/x" and cfg.cache_dir == "/c"
    assert cfg.cache_size == 20 << 30          # env beats file
    assert cfg.upload_delay == 9.0             # flag beats env
    assert cfg.min_free == 2 << 30             # file beats default
    assert cfg.writeback_cache is False
    assert cfg.upload_parallel == 8            # default


def test_env_alone_is_enough():
    env = {"TIERFS_COLD_URL": "s3://b/p", "TIERFS_MOUNTPOINT": "/m", "TIERFS_CACHE_DIR": "/c",
           "TIERFS_ALLOW_OTHER": "no", "TIERFS_CACHE_POLICY": "no-replace"}
    cfg = build_config({}, None, env)
    assert (cfg.cold_url, cfg.allow_other, cfg.cache_policy) == ("s3://b/p", False, "no-replace")


@pytest.mark.parametrize("content,message", [
    ('cache_sise = "1G"', "unknown option 'cache_sise'"),
    ('cache_size = "huge"', 'cache_size = "huge" in config file .* is not a size'),
    ('cache_policy = "mru"', "choose one of lru, no-replace"),
    ("cache_size = [", "not valid TOML"),
    ('cache-dir = "/a"\ncache_dir = "/b"', "sets 'cache_dir' twice: keep one of them"),
    ('mountpoint = ["/mnt/a"]', r"mountpoint in config file .* must be a non-empty string, not \['/mnt/a'\]"),
    ('cold_url = 7', "cold_url in config file .* must be a non-empty string, not 7"),
])
def test_bad_config_file(tmp_path, content, message):
    conf = tmp_path / "t.toml"
    conf.write_text(content)
    with pytest.raises(UserError, match=message):
        build_config(REQUIRED, str(conf), {})


def test_missing_required_names_all_sources():
    with pytest.raises(UserError, match="no cache-dir given.*TIERFS_CACHE_DIR.*--config"):
        build_config({"cold_url": "file:///x", "mountpoint": "/m"}, None, {})


def test_bad_env_value():
    with pytest.raises(UserError, match="TIERFS_UPLOAD_PARALLEL=many is not a whole number"):
        build_config(REQUIRED, None, {"TIERFS_UPLOAD_PARALLEL": "many"})


# ---- ranges: every option, from every source, named as the user wrote it --------------

BAD_VALUES = [
    # (option, value, message after the setting)
    ("cache_size", "0.5", "is not a whole number of bytes (a size without a unit counts "
                          "bytes): add a unit, e.g. 0.5G"),
    ("cache_size", "100", None),  # too small: checked with the minimum below
    ("cache_size", "-5G", "must be ≥ 0"),
    ("min_free", "-1G", "must be ≥ 0"),
    ("upload_delay", "-1", "must be ≥ 0"),
    ("upload_delay", "nan", "is not a finite number of seconds"),
    ("upload_parallel", "0", "is out of range: must be between 1 and 1024"),
    ("unmount_upload_timeout", "-0.5", "must be ≥ 0"),
    ("checkpoint_interval", "-300", "must be ≥ 0"),
    ("checkpoint_keep", "0", "must be ≥ 1"),
    ("cold_timeout", "0", "must be > 0"),
    ("write_wait", "-1", "must be ≥ 0"),
    ("attr_timeout", "-1", "must be ≥ 0"),
    ("read_ahead_kb", "-1", "must be ≥ 0"),
    ("metrics_port", "70000", "is out of range: must be between 0 and 65535"),
    ("metrics_port", "-1", "is out of range: must be between 0 and 65535"),
    ("extent_size", "3M", "is not a power of two: use one from 64K to 256M"),
    ("extent_size", "16K", "is out of range: must be between 64.0 KiB and 256.0 MiB"),
    ("extent_size", "1G", "is out of range: must be between 64.0 KiB and 256.0 MiB"),
    ("s3_endpoint", "127.0.0.1:45123",
     "has no scheme: use http://127.0.0.1:45123 or https://127.0.0.1:45123"),
    ("s3_endpoint", "ftp://host", "has scheme 'ftp': use http://host or https://host"),
    ("s3_endpoint", "http://", "names no host"),
    ("s3_endpoint", "http://my_host:9000", "has an invalid host name 'my_host'"),
    ("s3_endpoint", "http://host:99999", "has an invalid port"),
    ("s3_region", "us east", "is not a region name: use one like us-east-1"),
    ("upload_parallel", "2.5", "is not a whole number"),
    ("xattr", "maybe", "is not a switch: use true or false"),
    ("log_level", "LOUD", "is not a choice: choose one of DEBUG, INFO, WARNING, ERROR"),
]


def _from(source: str, name: str, value: str, tmp_path):
    """build_config with one option from `source`, and how its message names it."""
    if source == "flag":
        flag = "--" + name.replace("_", "-")
        return lambda: build_config({**REQUIRED, name: value}, None, {}), f"{flag} {value}"
    if source == "env":
        var = f"TIERFS_{name.upper()}"
        return lambda: build_config(REQUIRED, None, {var: value}), f"{var}={value}"
    conf = tmp_path / "t.toml"
    conf.write_text(f'{name} = "{value}"\n')
    return (lambda: build_config(REQUIRED, str(conf), {}),
            f'{name} = "{value}" in config file {conf}')


@pytest.mark.parametrize("source", ["flag", "env", "file"])
@pytest.mark.parametrize("name,value,message", BAD_VALUES)
def test_bad_values_are_refused_naming_setting_and_source(tmp_path, source, name, value,
                                                         message):
    build, what = _from(source, name, value, tmp_path)
    with pytest.raises(UserError) as e:
        build()
    text = str(e.value)
    if message is None:  # cache_size 100: the message shows the parsed size
        what = what.replace(value, "100 B", 1)  # not in the path: pytest-of-root/pytest-100
        message = ("is too small: the hot tier needs at least 8.0 MiB with the default "
                   "4.0 MiB extents, and never less than 1.1 MiB")
    assert text.startswith(f"{what} {message}"), text
    assert "\n" not in text


@pytest.mark.parametrize("toml,message", [
    ("cache_size = 0.5", "cache_size = 0.5 in config file .* is not a whole number of bytes"),
    ("cache_size = -5", "cache_size = -5 in config file .* must be ≥ 0"),
    ("cache_size = true", "cache_size = true in config file .* is not a size"),
    ("upload_delay = -1", "upload_delay = -1 in config file .* must be ≥ 0"),
    ("upload_parallel = 2.5", "upload_parallel = 2.5 in config file .* is not a whole number"),
    ("upload_parallel = true", "upload_parallel = true in config file .* is not a whole number"),
    ("metrics_port = 65536", "metrics_port = 65536 in config file .* must be between 0 and 65535"),
    ("upload_parallel = 99999999999999999999", "upload_parallel = .* must be between 1 and 1024"),
])
def test_native_toml_values_are_checked(tmp_path, toml, message):
    conf = tmp_path / "t.toml"
    conf.write_text(toml + "\n")
    with pytest.raises(UserError, match=message):
        build_config(REQUIRED, str(conf), {})


def test_values_at_the_limits_are_accepted(tmp_path):
    cfg = build_config({**REQUIRED, "upload_delay": "0", "upload_parallel": "1",
                        "checkpoint_keep": "1", "checkpoint_interval": "0", "write_wait": "0",
                        "cold_timeout": "0.1", "metrics_port": "65535", "read_ahead_kb": "0",
                        "min_free": "0", "cache_size": "0", "extent_size": "64K",
                        "s3_endpoint": "http://127.0.0.1:45123", "s3_region": "eu-west-3",
                        "log_level": "debug"}, None, {})
    assert (cfg.upload_parallel, cfg.checkpoint_keep, cfg.metrics_port, cfg.extent_size,
            cfg.cache_size, cfg.log_level) == (1, 1, 65535, 64 << 10, 0, "DEBUG")
    assert build_config({**REQUIRED, "cache_size": "1P"}, None, {}).cache_size == 1 << 50
    assert build_config({**REQUIRED, "extent_size": "256M"}, None, {}).extent_size == 256 << 20
    conf = tmp_path / "t.toml"
    conf.write_text("upload_parallel = 4.0\ncache_size = 1073741824\n")
    cfg = build_config(REQUIRED, str(conf), {})
    assert (cfg.upload_parallel, cfg.cache_size) == (4, GiB)


def test_cache_size_minimum_follows_the_extent_size():
    # One 1 MiB request touches 5 extents of 256 KiB: 1.25 MiB at least.
    with pytest.raises(UserError) as e:
        build_config({**REQUIRED, "cache_size": "1M", "extent_size": "256K"}, None, {})
    assert str(e.value) == ("--cache-size 1.0 MiB is too small for 256.0 KiB extents: one "
                            "request can touch 5 extents, so the hot tier needs at least "
                            "1.2 MiB; raise it")
    assert build_config({**REQUIRED, "cache_size": "2M", "extent_size": "256K"}, None,
                        {}).cache_size == 2 * MiB
    # Without --extent-size an existing filesystem may have small extents: only the
    # smallest possible minimum here (the real one is checked at mount).
    assert build_config({**REQUIRED, "cache_size": "3M"}, None, {}).cache_size == 3 * MiB
    with pytest.raises(UserError, match=r"^TIERFS_CACHE_SIZE=8.0 MiB is too small for "
                                        r"8.0 MiB extents.*at least 16.0 MiB"):
        build_config({**REQUIRED, "extent_size": "8M"}, None, {"TIERFS_CACHE_SIZE": "8M"})


def test_meta_map_sizes_are_consistent():
    with pytest.raises(UserError, match=r"--meta-max-map-size 1G is smaller than "
                                        r"--meta-map-size 2G"):
        build_config({**REQUIRED, "meta_map_size": "2G", "meta_max_map_size": "1G"}, None, {})


# ---- unknown TIERFS_* variables ---------------------------------------------------------

def test_unknown_env_variables_are_warned_about_with_the_closest_name():
    env = {"TIERFS_CACHESIZE": "200G", "TIERFS_UPLOADDELAY": "1", "TIERFS_ZZZ": "1",
           "TIERFS_CACHE_DIR": "/c", "TIERFS_DEMO_DIR": "/tmp/d", "HOME": "/root"}
    assert unknown_env_warnings(env) == [
        "tierfs: warning: unknown environment variable TIERFS_CACHESIZE ignored "
        "(did you mean TIERFS_CACHE_SIZE?)",
        "tierfs: warning: unknown environment variable TIERFS_UPLOADDELAY ignored "
        "(did you mean TIERFS_UPLOAD_DELAY?)",
        "tierfs: warning: unknown environment variable TIERFS_ZZZ ignored",
    ]


def test_no_warnings_inside_the_spawned_daemon():
    # Its caller warned already (and its stderr goes nowhere).
    assert unknown_env_warnings({"TIERFS_CACHESIZE": "1G", "TIERFS_READY_FD": "5"}) == []


def test_the_wait_for_a_daemons_answer_comes_from_the_environment(capsys):
    from tierfs.client import answer_wait_s
    assert answer_wait_s({}) == 10
    assert answer_wait_s({"TIERFS_ANSWER_WAIT": "2.5"}) == 2.5
    assert capsys.readouterr().err == ""
    for bad in ("0", "-1", "soon", "4000", "nan", ""):
        assert answer_wait_s({"TIERFS_ANSWER_WAIT": bad}) == 10
        err = capsys.readouterr().err
        assert err.startswith(f"tierfs: warning: TIERFS_ANSWER_WAIT='{bad}' ignored"), err
        assert err.count("\n") == 1 and "3600" in err, err
    assert "TIERFS_ANSWER_WAIT" in known_env()


def test_every_tierfs_variable_the_scripts_and_tests_use_is_known():
    mine = {Path(__file__).resolve(), REPO / "tests" / "fuse" / "test_mount_options.py"}
    used = set()
    for top in ("scripts", "tests", "deploy"):
        for path in (REPO / top).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".sh", ".yaml", ".service", ".toml",
                                                   ".example") and path.resolve() not in mine:
                used |= set(re.findall(r"\bTIERFS_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    assert used, "no TIERFS_ variable found: the scan is broken"
    assert used <= known_env(), used - known_env()
    assert {f"TIERFS_{o.name.upper()}" for o in OPTIONS} <= known_env()


# ---- --help: one default per option -----------------------------------------------------

def test_mount_help_shows_one_default_per_option():
    res = subprocess.run([sys.executable, "-m", "tierfs", "mount", "--help"],
                         capture_output=True, text=True, env=dict(os.environ, COLUMNS="100"),
                         timeout=60)
    assert res.returncode == 0, res.stderr
    options = res.stdout.split("\noptions:\n", 1)[1]
    entries: dict[str, str] = {}
    current = None
    for line in options.splitlines():
        m = re.match(r"  (-[-\w]+)", line)  # an option's first line; help lines indent more
        if m:
            current = m.group(1)
            entries[current] = line
        elif current:
            entries[current] += " " + line.strip()
    visible = {"--" + o.name.replace("_", "-") for o in OPTIONS if not o.hidden}
    assert visible <= set(entries), visible - set(entries)
    for flag, text in entries.items():
        count = len(re.findall(r"\bdefault:", text, re.IGNORECASE))
        assert count <= 1, f"{flag}: {text}"
        if flag in visible - {"--cache-dir"}:  # required: it has no default
            assert count == 1, f"{flag} shows no default: {text}"
    assert "(default: on when run as root)" in entries["--allow-other"]
    assert "(default: AWS_ENDPOINT_URL, else AWS)" in entries["--s3-endpoint"]


# ---- the hot tier's limit and the disk -------------------------------------------------

def _space(total, free, held=0, cache_size=0, min_free=GiB):
    """A Space over a stand-in engine whose cache disk has `total` bytes, `free` free."""
    frsize = 4096
    st = SimpleNamespace(f_blocks=total // frsize, f_bavail=free // frsize, f_frsize=frsize)
    engine = SimpleNamespace(index=SimpleNamespace(total=held),
                             hot=SimpleNamespace(root="/nvme/tierfs/hot", disk_usage=lambda: st))
    return Space(engine, cache_size=cache_size, min_free=min_free)


def test_default_limit_is_90_percent_of_what_the_disk_can_give():
    sp = _space(total=80 * GiB, free=40 * GiB, held=5 * GiB)   # a shared disk
    assert sp.high == int(0.9 * 44 * GiB)                       # 5 held + 40 free - 1 kept
    assert sp.low == int(sp.high * 0.9)
    assert sp.limit_note == ("default: 90% of the 44.0 GiB the cache disk can give "
                             "(40.0 GiB free now)")
    check_cache_size(sp, 4 * MiB)
    # Never more than 90% of the disk.
    assert _space(total=10 * GiB, free=10 * GiB, held=4 * GiB, min_free=0).high == 9 * GiB


def test_explicit_limit_says_so():
    sp = _space(total=80 * GiB, free=40 * GiB, cache_size=20 * GiB)
    assert (sp.high, sp.limit_note) == (20 * GiB, "--cache-size")
    sp = _space(total=80 * GiB, free=40 * GiB, cache_size=60 * GiB)
    assert sp.limit_note == "--cache-size; the cache disk can give only 39.0 GiB now"
    check_cache_size(sp, 4 * MiB)  # larger than the free space is allowed: it may free up


def test_cache_size_larger_than_the_disk_is_refused():
    sp = _space(total=80 * GiB, free=40 * GiB, cache_size=10 << 40)
    with pytest.raises(UserError) as e:
        check_cache_size(sp, 4 * MiB)
    assert str(e.value) == ("--cache-size 10.0 TiB is larger than the cache disk of "
                            "/nvme/tierfs (80.0 GiB in all, 40.0 GiB free): lower it, or "
                            "leave it out to use 90% of what the disk can give (35.1 GiB)")


def test_min_free_that_leaves_no_hot_tier_is_refused():
    sp = _space(total=80 * GiB, free=40 * GiB, min_free=100 * GiB)
    with pytest.raises(UserError) as e:
        check_cache_size(sp, 4 * MiB)
    assert str(e.value) == ("--min-free 100.0 GiB leaves the hot tier less than the 8.0 MiB "
                            "it needs on the cache disk of /nvme/tierfs (80.0 GiB in all, "
                            "40.0 GiB free): lower --min-free")
    # Also with an explicit --cache-size: every write would need room the disk cannot give.
    sp = _space(total=80 * GiB, free=40 * GiB, min_free=40 * GiB, cache_size=GiB)
    with pytest.raises(UserError, match="--min-free 40.0 GiB leaves the hot tier less"):
        check_cache_size(sp, 4 * MiB)


def test_full_disk_and_tiny_defaults_are_refused():
    sp = _space(total=80 * GiB, free=4 * MiB, min_free=0)
    with pytest.raises(UserError, match=r"cache disk of /nvme/tierfs \(80.0 GiB in all, "
                                        r"4.0 MiB free\) is too full for the hot tier, which "
                                        r"needs at least 8.0 MiB"):
        check_cache_size(sp, 4 * MiB)
    sp = _space(total=80 * GiB, free=8 * MiB, min_free=0)  # 90% of 8 MiB < 8 MiB
    with pytest.raises(UserError, match=r"^90% of what the cache disk .* is 7.2 MiB, less than "
                                        r"the 8.0 MiB that 4.0 MiB extents need"):
        check_cache_size(sp, 4 * MiB)
    sp = _space(total=80 * GiB, free=40 * GiB, cache_size=4 * MiB)
    with pytest.raises(UserError, match=r"^--cache-size 4.0 MiB is too small for 4.0 MiB "
                                        r"extents: one request can touch 2 extents"):
        check_cache_size(sp, 4 * MiB)


# ---- S3 settings boto3 would refuse ----------------------------------------------------

@pytest.mark.parametrize("env,message", [
    ({"AWS_ENDPOINT_URL": "127.0.0.1:45123"},
     "AWS_ENDPOINT_URL=127.0.0.1:45123 has no scheme: use http://127.0.0.1:45123 or "
     "https://127.0.0.1:45123"),
    ({"AWS_ENDPOINT_URL_S3": "localhost:9000", "AWS_ENDPOINT_URL": "http://ok:1"},
     "AWS_ENDPOINT_URL_S3=localhost:9000 has no scheme"),
    ({"AWS_CA_BUNDLE": ""}, "AWS_CA_BUNDLE is set but empty: unset it (unset AWS_CA_BUNDLE) "
                            "or set it to a CA bundle file"),
    ({"REQUESTS_CA_BUNDLE": " "}, "REQUESTS_CA_BUNDLE is set but empty"),
    ({"AWS_CA_BUNDLE": "/nonexistent/ca.pem"},
     "AWS_CA_BUNDLE=/nonexistent/ca.pem does not exist: set it to an existing CA bundle file"),
    ({"AWS_DEFAULT_REGION": "us east 1"},
     "AWS_DEFAULT_REGION=us east 1 is not a region name: use one like us-east-1"),
])
def test_s3_environment_problems_are_named(env, message):
    with pytest.raises(ColdConfigError) as e:
        check_s3_environment(env)
    assert str(e.value).startswith(message), str(e.value)


def test_s3_environment_that_boto3_accepts_passes(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("")
    check_s3_environment({"AWS_ENDPOINT_URL": "http://127.0.0.1:45123", "AWS_CA_BUNDLE": str(ca),
                          "AWS_DEFAULT_REGION": "us-east-1"})
    check_s3_environment({"AWS_ENDPOINT_URL": ""})  # empty: boto3 ignores it too
    # An explicit endpoint wins over the variables, and ignoring them is honoured.
    check_s3_environment({"AWS_ENDPOINT_URL": "bad:1"}, endpoint="http://127.0.0.1:1")
    check_s3_environment({"AWS_ENDPOINT_URL": "bad:1",
                          "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS": "true"})


@pytest.mark.parametrize("setup,message", [
    (lambda p: {"AWS_PROFILE": "nope"},
     "AWS profile 'nope' (AWS_PROFILE) is in neither the AWS config file nor the credentials "
     "file: fix AWS_PROFILE"),
    (lambda p: (p.write_text("not an ini file\n"), {"AWS_CONFIG_FILE": str(p)})[1],
     "cannot parse the AWS config file {p}: fix it, or point AWS_CONFIG_FILE"),
    (lambda p: (p.write_text("[default]\nregion = us east\n"), {"AWS_CONFIG_FILE": str(p)})[1],
     "S3 region 'us east' from the AWS config file is not a region name"),
    (lambda p: (p.write_text("[default]\nendpoint_url = 127.0.0.1:9\n"),
                {"AWS_CONFIG_FILE": str(p)})[1],
     "S3 endpoint '127.0.0.1:9' from the AWS config file (endpoint_url) is not a URL"),
])
def test_aws_configuration_errors_become_one_line(tmp_path, monkeypatch, setup, message):
    from tierfs.cold.s3 import S3Store
    for var in [v for v in os.environ if v.startswith("AWS_")]:
        monkeypatch.delenv(var)
    path = tmp_path / "aws-config"
    for var, value in setup(path).items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    with pytest.raises(ColdConfigError) as e:
        S3Store("bucket")
    assert str(e.value).startswith(message.format(p=path)), str(e.value)
