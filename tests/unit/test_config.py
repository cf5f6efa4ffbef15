"""Mount options from a TOML file, TIERFS_* variables and flags, with precedence."""
import pytest

from tierfs.config import build_config, parse_size
from tierfs.errors import UserError


def test_sizes_accept_units():
    assert parse_size("4096") == 4096
    assert parse_size("64M") == 64 << 20
    assert parse_size("200G") == 200 << 30
    assert parse_size("1.5T") == int(1.5 * (1 << 40))
    assert parse_size("8MiB") == 8 << 20
    with pytest.raises(UserError, match="invalid size"):
        parse_size("lots")


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
    ('cache_size = "huge"', "invalid size"),
    ('cache_policy = "mru"', "choose one of lru, no-replace"),
    ("cache_size = [", "not valid TOML"),
])
def test_bad_config_file(tmp_path, content, message):
    conf = tmp_path / "t.toml"
    conf.write_text(content)
    with pytest.raises(UserError, match=message):
        build_config({"cold_url": "file:///x", "mountpoint": "/m", "cache_dir": "/c"},
                     str(conf), {})


def test_missing_required_names_all_sources():
    with pytest.raises(UserError, match="no cache-dir given.*TIERFS_CACHE_DIR.*--config"):
        build_config({"cold_url": "file:///x", "mountpoint": "/m"}, None, {})


def test_bad_env_value():
    with pytest.raises(UserError, match="TIERFS_UPLOAD_PARALLEL"):
        build_config({"cold_url": "file:///x", "mountpoint": "/m", "cache_dir": "/c"}, None,
                     {"TIERFS_UPLOAD_PARALLEL": "many"})
