"""Config loading: every error names the file, the key and the reason."""

from __future__ import annotations

import pytest

from pathlib import Path

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
    (GOOD_REPLICA + GOOD_REPLICA.replace("8001", "8002").replace("vllm-a", "vllm-b"), "replicas", "same name 'a'"),
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
    ("[memory]\nrestore = true\n", "memory", "not built yet"),
    ("[memory]\npeer_urls = [\"box2:8000\"]\n", "memory", "peer_urls"),
    ("[memory]\npriority = [\"z\"]\n" + GOOD_REPLICA, "", "memory.priority names no configured replica: z"),
    ("[memory]\nfloor = 1.2\n", "memory.floor", "less than 1"),
])
def test_config_errors_name_key_and_reason(tmp_path, text, key, reason):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert msg.startswith(f"config error in {path}: ")
    assert f"{key}:" in msg or (key == "" and "invalid TOML" in msg), msg
    assert reason in msg, msg


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
