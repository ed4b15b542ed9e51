"""Config loading: every error names the file, the key and the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from guardian.config import ConfigError, load_config

GOOD_REPLICA = '[[replicas]]\nname = "a"\nunit = "vllm-a.service"\nurl = "http://127.0.0.1:8001"\nmodel = "m"\n'


def write(tmp_path, text):
    p = tmp_path / "guardian.toml"
    p.write_text(text)
    return p


def test_minimal_config_gets_documented_defaults(tmp_path):
    cfg = load_config(write(tmp_path, GOOD_REPLICA))
    assert cfg.interval_s == 2.0 and cfg.dry_run is False
    assert cfg.watchdog.stall_window_s == 60 and cfg.watchdog.unresponsive_after_s == 10
    assert cfg.watchdog.restart_budget == 3 and cfg.watchdog.restart_window_s == 1800
    r = cfg.replicas[0]
    assert r.startup_grace_s >= 15 * 60  # covers a 15-minute model load
    assert r.port == 8001 and r.url == "http://127.0.0.1:8001"


@pytest.mark.parametrize("text, key, reason", [
    ("intervl_s = 2\n" + GOOD_REPLICA, "intervl_s", "unknown key"),
    ("interval_s = \"fast\"\n" + GOOD_REPLICA, "interval_s", "valid number"),
    ("interval_s = -1\n" + GOOD_REPLICA, "interval_s", "greater than 0"),
    ("[watchdog]\nstall_window_s = 0\n" + GOOD_REPLICA, "watchdog.stall_window_s", "greater than 0"),
    ("[watchdog]\nrestart_budget = 0\n" + GOOD_REPLICA, "watchdog.restart_budget", "greater than or equal to 1"),
    ("[watchdog]\nstal_window_s = 5\n" + GOOD_REPLICA, "watchdog.stal_window_s", "unknown key"),
    (GOOD_REPLICA + GOOD_REPLICA.replace("8001", "8002").replace("vllm-a", "vllm-b"), "replicas", "same name: 'a' and 'a'"),
    (GOOD_REPLICA + GOOD_REPLICA.replace('"a"', '"b"').replace("8001", "8002"), "replicas", "same unit"),
    (GOOD_REPLICA.replace("vllm-a.service", "vllm-a"), "replicas.0.unit", "ending in '.service'"),
    (GOOD_REPLICA.replace("vllm-a.service", "vllm-a.socket"), "replicas.0.unit", "ending in '.service'"),
    (GOOD_REPLICA.replace("http://127.0.0.1:8001", "127.0.0.1:8001"), "replicas.0.url", "http:// or https://"),
    (GOOD_REPLICA.replace("http://127.0.0.1:8001", "http://127.0.0.1:99999"), "replicas.0.url", "invalid port"),
    (GOOD_REPLICA.replace('model = "m"\n', ""), "replicas.0.model", "required key is missing"),
    (GOOD_REPLICA.replace('name = "a"', 'name = "a b"'), "replicas.0.name", "pattern"),
    (GOOD_REPLICA + "startup_grace_s = 0\n", "replicas.0.startup_grace_s", "greater than 0"),
    (GOOD_REPLICA + "colour = 1\n", "replicas.0.colour", "unknown key"),
    ("[memory]\nmin_headroom_bytes = 1\ncritical_headroom_bytes = 2\n", "memory", "critical_headroom_bytes must be <="),
    ("interval_s = \n", "", "invalid TOML"),
    ("[memory]\nsustain_s = 600\n", "memory", "restore_after_s (600 s) must be > sustain_s (600 s)"),
    ("[memory]\nrestore_after_s = 30\n", "memory", "restore_after_s (30 s) must be > sustain_s (30 s)"),
    ("[memory]\nrestore_after_s = 0\n", "memory.restore_after_s", "greater than 0"),
    ("[memory]\nrestore_cooldown_s = -1\n", "memory.restore_cooldown_s", "greater than or equal to 0"),
    ("[memory]\npeer_urls = [\"box2:8000\"]\n", "memory", "peer_urls"),
    ("[memory]\npriority = [\"z\"]\n" + GOOD_REPLICA, "", "memory.priority names no configured replica: z"),
    ("[memory]\nfloor = 1.2\n", "memory.floor", "less than 1"),
    # hostile or careless input (issue 10): never accepted, always named
    ("interval_s = inf\n" + GOOD_REPLICA, "interval_s", "finite"),
    ("interval_s = nan\n" + GOOD_REPLICA, "interval_s", "finite"),
    ("[watchdog]\nstall_window_s = 1e308\n" + GOOD_REPLICA, "watchdog.stall_window_s", "less than or equal to 2592000"),
    (GOOD_REPLICA + "health_timeout_s = inf\n", "replicas.0.health_timeout_s", "finite"),
    ("interval_s = 60\n" + GOOD_REPLICA, "", "interval_s = 60: must be <= 7.5 s, a quarter of systemd's watchdog"),
    (GOOD_REPLICA + "metrics_timeout_s = 10\n", "", "replicas.0.metrics_timeout_s = 10: must be <= 7.5 s"),
    (GOOD_REPLICA.replace("vllm-a.service", "foo;rm.service"), "replicas.0.unit", "systemd service unit name"),
    (GOOD_REPLICA.replace('"vllm-a.service"', '"vllm-a\\n<2>fake.service"'), "replicas.0.unit", "systemd service unit name"),
    (GOOD_REPLICA.replace("vllm-a.service", "vllm-replica@.service"), "replicas.0.unit", "systemd service unit name"),
    (GOOD_REPLICA.replace("http://127.0.0.1:8001", "http://127.0.0.1:18\\n001"), "replicas.0.url", "control character"),
    (GOOD_REPLICA.replace("http://127.0.0.1:8001", "http://user:secret@127.0.0.1:8001"), "replicas.0.url",
     "must not carry a user or password"),
    (GOOD_REPLICA.replace("http://127.0.0.1:8001", "http://127.0.0.1:0"), "replicas.0.url", "port 0"),
    (GOOD_REPLICA.replace("http://127.0.0.1:8001", "http://127.0.0.1:8001/?x=1"), "replicas.0.url", "query"),
    (GOOD_REPLICA + GOOD_REPLICA.replace('"a"', '"A"').replace("vllm-a", "vllm-b").replace("8001", "8002"),
     "replicas", "same name: 'a' and 'A'"),
    (GOOD_REPLICA + GOOD_REPLICA.replace('"a"', '"b"').replace("vllm-a", "VLLM-A").replace("8001", "8002"),
     "replicas", "same unit"),
    (GOOD_REPLICA + GOOD_REPLICA.replace('"a"', '"b"').replace("vllm-a", "vllm-b").replace("127.0.0.1", "localhost"),
     "replicas", "same address: 'a' and 'b'"),
    ('state_dir = ""\n', "state_dir", "absolute directory"),
    ("[memory]\npeer_urls = [\"http://u:p@box2:8000\"]\n", "memory", "user or password"),
    # issue 21: a host that carries nginx syntax into its include file (nginx -t then always fails)
    *[(GOOD_REPLICA.replace('"http://127.0.0.1:8001"', json.dumps(f"http://{host}:8001")), "replicas.0.url",
       f"host {host!r} is not a host name")
      for host in ("a;b", "a{b}", "a}", '"a"', "a'b", "$host", "`id`", "-a", "a-", "a..b", "a_b", "1.2.3.999",
                   "256.0.0.1", "010.0.0.1", "example.123", "[fe80::1%25eth0]", "[::1]x", "x" * 64)],
    (GOOD_REPLICA.replace("127.0.0.1", "[::1;]"), "replicas.0.url", "'::1;' does not appear to be an IPv4 or IPv6"),
    (GOOD_REPLICA.replace("127.0.0.1", "[::1"), "replicas.0.url", "is not a URL"),
    ("[memory]\npeer_urls = [\"http://box2;:8000\"]\n", "memory", "peer_urls: 'http://box2;:8000': host 'box2;'"),
    ("[fleet]\nendpoints = [\"http://etcd{1}:2379\"]\n", "fleet.endpoints", "host 'etcd{1}' is not a host name"),
    ("[proxy]\nserver_host = \"::1\"\n", "proxy.server_host", "host '::1' is not a host name"),
    ("[proxy]\nserver_host = \"10.0.0.5;\"\n", "proxy.server_host", "host '10.0.0.5;' is not a host name"),
    ("[memory]\nfloor = 0.001\n", "memory.floor", "greater than or equal to 0.01"),
])
def test_config_errors_name_key_and_reason(tmp_path, text, key, reason):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert msg.startswith(f"config error in {path}: ")
    assert f"{key}:" in msg or (key == "" and "invalid TOML" in msg), msg
    assert reason in msg, msg


def test_deep_nesting_and_bad_json_in_the_environment_are_config_errors(tmp_path, monkeypatch):
    """Both used to escape as a traceback and exit 1, which RestartPreventExitStatus=2 does not stop."""
    deep = write(tmp_path, "x = " + "[" * 500 + "]" * 500 + "\n")
    with pytest.raises(ConfigError, match="config error in"):
        load_config(deep)
    path = write(tmp_path, GOOD_REPLICA)
    monkeypatch.setenv("GUARDIAN_REPLICAS", '[{"name": "a", ')
    with pytest.raises(ConfigError, match="GUARDIAN_REPLICAS|replicas"):
        load_config(path)


def test_the_watchdog_limit_follows_systemds_watchdog_usec(tmp_path, monkeypatch):
    path = write(tmp_path, "interval_s = 9\n" + GOOD_REPLICA)
    with pytest.raises(ConfigError, match="interval_s = 9: must be <= 7.5 s"):
        load_config(path)
    monkeypatch.setenv("WATCHDOG_USEC", str(60_000_000))  # WatchdogSec=60s
    assert load_config(path).interval_s == 9
    monkeypatch.setenv("WATCHDOG_USEC", str(20_000_000))
    with pytest.raises(ConfigError, match="must be <= 5 s"):
        load_config(path)


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.toml")
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(tmp_path / "bin.toml")


def test_environment_overrides_the_file_and_is_named_when_wrong(tmp_path, monkeypatch):
    path = write(tmp_path, "[watchdog]\nstall_window_s = 30\n" + GOOD_REPLICA)
    monkeypatch.setenv("GUARDIAN_WATCHDOG__STALL_WINDOW_S", "90")
    monkeypatch.setenv("GUARDIAN_DRY_RUN", "true")
    cfg = load_config(path)
    assert cfg.watchdog.stall_window_s == 90 and cfg.dry_run is True
    monkeypatch.setenv("GUARDIAN_INTERVAL_S", "soon")
    with pytest.raises(ConfigError, match="GUARDIAN_INTERVAL_S"):
        load_config(path)


def test_shipped_example_config_is_valid():

    path = Path(__file__).resolve().parent.parent / "packaging" / "guardian.toml"
    assert load_config(path).replicas == []
    # and the commented replica is valid once uncommented
    uncommented = path.read_text().replace("# [[replicas]]", "[[replicas]]").replace("# name", "name").replace(
        "# unit", "unit").replace("# url", "url").replace("# model", "model").replace("# startup", "startup")
    head, _, tail = uncommented.partition("[memory]")
    cfg = load_config_text(path.parent, head)
    assert cfg.replicas[0].unit == "vllm-replica@a.service"


def load_config_text(tmp, text):
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(text)
    try:
        return load_config(Path(f.name))
    finally:
        Path(f.name).unlink()


@pytest.mark.parametrize("host", ["localhost", "box-2", "gpu7.example.com", "A1.B2", "10.0.0.2", "[::1]",
                                  "[2001:db8::7]", "[::ffff:10.0.0.1]", "x" * 63 + ".example"])
def test_host_names_and_ip_literals_are_accepted_in_every_url(tmp_path, host):
    text = GOOD_REPLICA.replace("127.0.0.1", host) + f'[memory]\npeer_urls = ["http://{host}:8000"]\n'
    text += f'[fleet]\nendpoints = ["https://{host}:2379"]\n'
    if not host.startswith("["):  # nginx takes an IPv6 server address in brackets too, checked above
        text = f'[proxy]\nserver_host = "{host}"\n' + text
    cfg = load_config(write(tmp_path, text))
    assert cfg.replicas[0].url == f"http://{host}:8001"
    assert cfg.memory.peer_urls == [f"http://{host}:8000"] and cfg.fleet.endpoints == [f"https://{host}:2379"]


# --- raising fractions back (issue 25) -----------------------------------------------------------------

def test_restore_is_on_by_default_with_its_hysteresis_and_cooldown(tmp_path):
    m = load_config(write(tmp_path, GOOD_REPLICA)).memory
    assert (m.restore, m.restore_after_s, m.restore_cooldown_s) == (True, 600.0, 600.0)
    assert m.restore_after_s > m.sustain_s


@pytest.mark.parametrize("text, valid", [
    ("[memory]\nsustain_s = 599.9\n", True),  # restore_after_s 600 > 599.9
    ("[memory]\nsustain_s = 600\n", False),  # not > : a squeeze and a clear headroom would last as long
    ("[memory]\nsustain_s = 900\nrestore = false\n", True),  # restore off: the hysteresis is not used
    ("[memory]\nsustain_s = 900\nrestore_after_s = 901\n", True),
])
def test_restore_after_s_must_exceed_sustain_s(tmp_path, text, valid):
    path = write(tmp_path, text + GOOD_REPLICA)
    if valid:
        load_config(path)
    else:
        with pytest.raises(ConfigError, match="restore_after_s .* must be > sustain_s"):
            load_config(path)
