"""fl_geo.bench.flower_path: Flower's own message path on a loopback SuperLink + SuperNode.

The end-to-end test is slow (SuperLink and SuperNode start-up, a 3 s idle poll on the node and a
fresh ClientApp process per message: about 30 s for three round trips), so it sends 8 MiB once.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from fl_geo.bench import flower_path
from fl_geo.deploy import processes

# SuperLink/SuperNode processes on free ports, each test its own: safe on both of `make test`'s workers.

MIB = 1 << 20


def _processes_with_flwr_home(home: Path) -> list[int]:
    """Live processes whose environment has FLWR_HOME=home: everything the federation started
    (SuperLink, SuperNode, their flower-superexec, ServerApp and ClientApp children) inherits it."""
    needle = f"FLWR_HOME={home}".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0") and processes._alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def test_probe_app_is_a_flower_app_with_the_run_config_keys():
    import tomllib

    conf = tomllib.loads((flower_path.APP_DIR / "pyproject.toml").read_text(encoding="utf-8"))
    app = conf["tool"]["flwr"]["app"]
    assert app["components"] == {"serverapp": "flower_path_probe.server_app:app",
                                 "clientapp": "flower_path_probe.client_app:app"}
    assert {"payload_mib", "repeats", "out"} <= set(app["config"])


@pytest.fixture
def probe():
    """The probe's ServerApp module, imported from the app folder as Flower would."""
    import importlib
    import sys

    sys.path.insert(0, str(flower_path.APP_DIR))
    try:
        yield importlib.import_module("flower_path_probe.server_app")
    finally:
        sys.path.remove(str(flower_path.APP_DIR))


def test_payload_differs_per_round_trip_and_the_check_wants_every_word_flipped(probe):
    import numpy as np

    n = probe.BLOCK_ELEMS + 1000  # crosses a generation block
    a, b = probe.make_payload(n, salt=2), probe.make_payload(n, salt=3)
    assert a.dtype == np.float32 and a.shape == (n,)
    words = np.sort(a.view(np.uint32))  # np.unique hashes: ~7 CPU-s here; a sort is ~0.04 s
    assert (words[1:] != words[:-1]).all()  # all n words distinct: no repeated 5 MiB chunk to deduplicate
    assert not np.array_equal(a.view(np.uint32), b.view(np.uint32))
    flipped = (a.view(np.uint32) ^ np.uint32(1)).view(np.float32)
    assert probe.verify_reply(flipped, n, salt=2)
    assert not probe.verify_reply(a, n, salt=2)  # a byte-identical echo is not what the client sends
    flipped.view(np.uint32)[-1] ^= np.uint32(2)
    assert not probe.verify_reply(flipped, n, salt=2)
    assert not probe.verify_reply(flipped[:-1], n, salt=2)


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match=">= 1"):
        flower_path.measure_flower_path(0)


@pytest.mark.slow(seconds=47)
def test_flower_path_8_mib_round_trip_on_loopback(tmp_path):
    result = flower_path.measure_flower_path(8, workdir=tmp_path, timeout_s=300)

    assert result["payload_bytes"] == 8 * MIB
    assert result["echo_verified"] is True
    assert len(result["round_trip_s"]) == 1 and result["round_trip_s"][0] > 0
    mbps = result["mb_per_s_each_way"]
    assert math.isfinite(mbps) and mbps > 0
    assert mbps == pytest.approx(2 * 8 * MIB / 1e6 / result["median_round_trip_s"])
    assert result["setup_s"] > 0 and result["run_s"] > 0 and result["wall_s"] >= result["run_s"]
    assert 0 < result["peak_rss_serverapp_mib"] < 4096
    assert result["peak_rss_mib"]["total"] > 0
    saved = json.loads(next(tmp_path.glob("probe-*.json")).read_text())
    assert saved["payload_bytes"] == 8 * MIB  # the ServerApp's own file

    # Nothing left running: every process seen, and anything carrying this FLWR_HOME.
    assert result["pids"] and not [p for p in result["pids"] if processes._alive(p)]
    assert not _processes_with_flwr_home(tmp_path / "flwr")
    assert not (tmp_path / "state" / "pids.json").exists()
    assert os.path.isfile(tmp_path / "state" / "logs" / "supernode-probe.log")
