"""The same weights behind one name (issue 33 item 1), in a real systemd: two simulated replicas
served as one model name, each loading its own model directory (its config.json differs; or, issue 44,
only its tensor bytes differ, as a fine-tune differs from its base). guardian says the hazard once
(W1), `guardian status` and `guardian check` show it with each fingerprint; once b is updated to a's
weights and restarted, the change is said (W2) and the hazard is over."""

from __future__ import annotations

import json

import pytest

from systemd_box import wait_for
from world import Replica, line_with

pytestmark = pytest.mark.system

# A real safetensors file (its u64 header length, its JSON header, the tensor) of 1 MiB of bytes drawn
# from a seed: every seed gives the same size, header and name, and other bytes.
SAFETENSORS = """
import json, random, struct, sys
path, seed = sys.argv[1], int(sys.argv[2])
data = random.Random(seed).randbytes(1 << 20)
header = json.dumps({"w": {"dtype": "U8", "shape": [len(data)], "data_offsets": [0, len(data)]}}).encode()
header += b" " * (-len(header) % 8)
with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(header)) + header + data)
"""


def test_two_replicas_of_one_name_with_different_weights_are_a_hazard_until_they_match(world):
    world.box.write("/opt/models/a/config.json", json.dumps({"num_hidden_layers": 32}))
    world.box.write("/opt/models/b/config.json", json.dumps({"num_hidden_layers": 36}))
    world.replicas = [Replica("a", 8001, model_path="/opt/models/a"), Replica("b", 8002, model_path="/opt/models/b")]
    try:
        world.setup()
        hazard = line_with(world, "with different weights", "GUARDIAN_HAZARD=weights-differ:sim-model", timeout_s=30)
        assert hazard["PRIORITY"] == "3" and hazard["GUARDIAN_RULE"] == "W1", hazard
        assert "config.json of /opt/models/a" in hazard["MESSAGE"] and "/opt/models/b" in hazard["MESSAGE"]
        status = world.box.run(["guardian", "status"]).stdout
        assert "serve model sim-model with different weights" in status and "weights dir2:" in status, status
        check = world.box.run(["guardian", "check"], check=False)
        assert check.returncode != 0 and "hazard: replicas a, b serve model sim-model" in check.stdout, check.stdout
        assert "weights: replica a: dir2:" in check.stdout
        # b updated to a's weights (a model update) and restarted
        world.box.write("/opt/models/b/config.json", json.dumps({"num_hidden_layers": 32}))
        world.box.systemctl("restart", "vllm-b.service")
        line_with(world, "its weights changed", "GUARDIAN_REPLICA=b", "GUARDIAN_RULE=W2", timeout_s=30)
        line_with(world, "hazard over: sim-model's replicas serve the same weights", timeout_s=30)
        wait_for(lambda: "different weights" not in world.box.run(["guardian", "status"]).stdout, 20,
                 "guardian status without the hazard")
        assert len(world.guardian_messages("GUARDIAN_HAZARD=weights-differ:sim-model")) == 1  # said once
    finally:
        world.box.run(["rm", "-rf", "/opt/models"], check=False)


def test_two_replicas_whose_weights_differ_in_content_only_are_a_hazard_until_they_match(world):
    """A fine-tune beside its base: the same config.json, file name and size, other tensor bytes."""
    for name, seed in (("a", 1), ("b", 2)):
        world.box.write(f"/opt/models/{name}/config.json", json.dumps({"num_hidden_layers": 32}))
        world.box.run(["python3", "-c", SAFETENSORS, f"/opt/models/{name}/model.safetensors", str(seed)])
    world.replicas = [Replica("a", 8001, model_path="/opt/models/a"), Replica("b", 8002, model_path="/opt/models/b")]
    try:
        world.setup()
        hazard = line_with(world, "with different weights", "GUARDIAN_HAZARD=weights-differ:sim-model", timeout_s=30)
        assert hazard["PRIORITY"] == "3" and hazard["GUARDIAN_RULE"] == "W1", hazard
        assert "sampled bytes" in hazard["MESSAGE"] and "/opt/models/b" in hazard["MESSAGE"], hazard["MESSAGE"]
        check = world.box.run(["guardian", "check"], check=False)
        assert check.returncode != 0 and "hazard: replicas a, b serve model sim-model" in check.stdout, check.stdout
        # b brought to a's weights (the same bytes copied over) and restarted
        world.box.run(["cp", "/opt/models/a/model.safetensors", "/opt/models/b/model.safetensors"])
        world.box.systemctl("restart", "vllm-b.service")
        line_with(world, "its weights changed", "GUARDIAN_REPLICA=b", "GUARDIAN_RULE=W2", timeout_s=30)
        line_with(world, "hazard over: sim-model's replicas serve the same weights", timeout_s=30)
        assert len(world.guardian_messages("GUARDIAN_HAZARD=weights-differ:sim-model")) == 1  # said once
    finally:
        world.box.run(["rm", "-rf", "/opt/models"], check=False)
