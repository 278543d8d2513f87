"""Shared fixtures: a tiny but real configuration that runs the whole ServerApp <-> ClientApp path
in about a second (in-process InlineGrid, pydoc corpus, 1-layer model)."""

from __future__ import annotations

import os

# One intra-op thread in every test (`_seed_and_threads`), in the threads they start and in the
# processes they start (ClientApps, ranks and followers inherit the variable), unless the caller
# set OMP_NUM_THREADS. `make test` runs three workers on two cores beside the deployments'
# processes: two OpenMP threads per test oversubscribe the cores, and threads that spin while
# they wait burn CPU the other tests need (six heavy in-process test files, 3 workers, idle
# machine: 146 and 126 CPU-s with one thread against 152 and 159 with two). The runs whose bits
# are recorded set their threads themselves (`run.threads_per_client`, `run.server_threads`).
# Set before torch is imported: OpenMP reads it once, and every thread a test starts (an in-process
# follower, a server) gets that count; `set_num_threads` only changes the calling thread. Under
# `-n 0` torch was imported first and such threads ran two OpenMP threads, so a follower thread's
# float sums differed in the last bit from the test's own.
os.environ.setdefault("OMP_NUM_THREADS", "1")
TEST_THREADS = int(os.environ["OMP_NUM_THREADS"])

from tests.data import pin_pydoc_topics  # noqa: E402  (after OMP_NUM_THREADS, above)

# The pydoc corpus is the one the records were taken on, whichever Python runs the tests, here and in
# every process the tests start (they inherit the variable): tests/data/__init__.py.
pin_pydoc_topics()

import pytest  # noqa: E402  (after OMP_NUM_THREADS, above)
import torch  # noqa: E402  (after OMP_NUM_THREADS, above)
from flwr.app import RecordDict  # noqa: E402  (after OMP_NUM_THREADS, above)

from fl_geo.config import FlGeoConfig, load_config  # noqa: E402  (after OMP_NUM_THREADS, above)
from fl_geo.deploy.processes import free_ports  # noqa: E402, F401  (re-exported: the deployment tests import it from here)
from fl_geo.runtime.protocol import REQUEST_RECORD  # noqa: E402  (after OMP_NUM_THREADS, above)

TINY = [
    "run.rounds=2",
    "run.num_clients=3",
    "run.backend=inline",
    "run.tensorboard=false",
    "run.progress=false",
    "run.eval_batches=2",
    "run.sim_cpus=1",
    "model.n_layers=1",
    "model.d_model=32",
    "model.n_heads=2",
    "model.max_seq_len=32",
    "client.seq_len=32",
    "client.batch_size=4",
    "client.warmup_steps=2",
    "client.eval_batches=2",
    "strategy.inner_steps=3",
    "data.corpus=pydoc",
    "data.partition=iid",
]


def pytest_sessionstart(session):
    """On pytest-xdist workers: while a Ray test runs, the sessions the other workers' tests
    started (deployments, followers) yield the CPU to it (`tests.cpu_share`)."""
    import tempfile
    from pathlib import Path

    from tests.cpu_share import CpuShare

    run = getattr(session.config, "workerinput", {}).get("testrunuid")
    if run and CpuShare.available():
        session.config.stash[CPU_SHARE] = CpuShare(Path(tempfile.gettempdir()) / f"fl-geo-cpu-share-{run}").start()


def pytest_sessionfinish(session):
    if (share := session.config.stash.get(CPU_SHARE, None)) is not None:
        share.stop()


@pytest.fixture(autouse=True)
def _ray_holds_the_cpu_share(request):
    """A test of the ``ray`` xdist group holds the share: other workers' sessions yield meanwhile."""
    share = request.config.stash.get(CPU_SHARE, None)
    if share is None or not any(m.args[:1] == ("ray",) for m in request.node.iter_markers("xdist_group")):
        yield
        return
    with share.hold():
        yield


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped where torch sees no CUDA device (CI, this laptop); under
    ``--dist loadgroup`` each test's ``xdist_group`` reaches the scheduler (`_tag_xdist_groups`)
    and the tests marked ``slow`` are handed out first (`_slow_first`)."""
    _assign_lanes(config, items)
    _tag_xdist_groups(config, items)
    _slow_first(config, items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (make gpu-check on a GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


CPU_SHARE = pytest.StashKey[object]()
DEFAULT_SLOW_SECONDS = 30.0  # a ``slow`` test that does not say how long it takes
LANE = pytest.StashKey[str]()  # the xdist group `_assign_lanes` chose, replacing the test's own


def _assign_lanes(config, items) -> None:
    """Under ``-n N`` (N >= 3), put every ``slow`` test and every ``xdist_group`` into one of N - 1
    lanes (xdist groups ``lane-1``, ...), balanced by the seconds each ``slow`` marker states
    (``@pytest.mark.slow(seconds=...)``, else 30; a grouped test that is not slow counts 1 s),
    longest first onto the least loaded lane.

    Why: the slow tests start Flower federations, Ray and killed processes, a dozen processes each.
    Three of them at once on a 2-core machine overloaded it so far that a Ray simulation's actors
    did not answer within the run's 120 s node wait (CI, 2026-11-28: two Ray tests at 183 s and
    186 s, 13 s idle). Lanes keep at most N - 1 of them running at once and one worker on the
    light tests; a group stays whole (the Ray tests one at a time), so a group is moved as a unit.
    """
    workers = int(getattr(config, "workerinput", {}).get("workercount", 0))
    if workers < 3:
        return
    units: dict[str, list] = {}
    for item in items:
        group = next((str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                      for m in item.iter_markers("xdist_group")), None)
        if group is not None or item.get_closest_marker("slow") is not None:
            units.setdefault(group or item.nodeid, []).append(item)

    def cost(unit: list) -> float:
        return sum(float(m.kwargs.get("seconds", DEFAULT_SLOW_SECONDS)) if (m := i.get_closest_marker("slow")) else 1.0
                   for i in unit)

    load = {f"lane-{k + 1}": 0.0 for k in range(workers - 1)}
    for unit in sorted(units.values(), key=cost, reverse=True):
        lane = min(load, key=load.__getitem__)
        load[lane] += cost(unit)
        for item in unit:
            item.stash[LANE] = lane


def _tag_xdist_groups(config, items) -> None:
    """Append ``@<group>`` to the node id of every test marked ``xdist_group``, as pytest-xdist does.

    Why here: pytest-xdist 3.8 tags a test by assigning ``item._nodeid``, but pytest 9 derives
    ``item.nodeid`` from ``item._id``, so the tag never reaches the scheduler and the SuperLink and
    Ray tests ran on both workers at once (measured: each 2-3x slower, and two of them timed out
    under load). Setting ``_id`` makes ``--dist loadgroup`` keep each group on one worker.
    """
    if not getattr(config.option, "loadgroup", False) and getattr(config.option, "dist", "no") != "loadgroup":
        return
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # an older pytest, where pytest-xdist's own tagging works
        return
    for item in items:
        groups = [item.stash[LANE]] if LANE in item.stash else \
            sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")})
        if groups and "@" not in item.nodeid:
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(groups)}")


def _slow_first(config, items) -> None:
    """Under ``-n``, move the tests marked ``slow`` (the deployments, Ray, killed processes: each
    30-100 s) to the front, keeping the order otherwise. The scheduler hands tests out in
    collection order, so a long test collected late was started when the other workers had little
    left and ran on alone at the end; slow first keeps every worker busy to the end."""
    if not hasattr(config, "workerinput"):  # only a pytest-xdist worker's collection is scheduled
        return
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: False (slow) first


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    torch.set_num_threads(TEST_THREADS)


def tiny_overrides(*extra: str, drop: tuple[str, ...] = ()) -> list[str]:
    """TINY without the keys in ``drop``, then ``extra`` (the deployment tests' run overrides)."""
    return [o for o in TINY if o.split("=", 1)[0] not in drop] + list(extra)


def tiny_config(*overrides: str) -> FlGeoConfig:
    return load_config(None, [*TINY, *overrides])


@pytest.fixture
def tiny():
    return tiny_config


def tiny_scenario_dict(**extra) -> dict:
    """Two regions, asymmetric links with latency; server in A.

    Node 0 in A (speed 1), nodes 1 and 2 in B (speeds 2 and 0.5); 1 s per step at speed 1.
    """
    d = {
        "name": "tiny",
        "server_region": "A",
        "regions": ["A", "B"],
        "links": {"bandwidth_gbps": [[80.0, 8.0], [4.0, 40.0]], "latency_s": [[0.0, 0.5], [0.25, 0.0]]},
        "model": {"num_params": 1000, "step_time_s": 1.0},
        "nodes": [{"region": "A"}, {"region": "B", "speed": 2.0}, {"region": "B", "speed": 0.5}],
    }
    d.update(extra)
    return d


def keep_declaration(reply, records: dict) -> RecordDict:
    """``records`` as a reply's content, with ``reply``'s fl-geo declaration (protocol version,
    payload, precision) kept: a test that tampers with a reply's arrays or metrics keeps it an
    fl-geo reply instead of turning it into a Flower-convention one."""
    decl = reply.content.config_records.get(REQUEST_RECORD)
    return RecordDict({**records, **({REQUEST_RECORD: decl} if decl is not None else {})})


def peak_rss_growth(fn) -> int | None:
    """Peak RSS growth (bytes) while running fn, or None where VmHWM cannot be reset (Linux
    only: writing 5 to /proc/self/clear_refs resets the high-water mark)."""
    import re

    def status(field: str) -> int:
        with open("/proc/self/status") as fh:
            return int(re.search(rf"^{field}:\s+(\d+) kB", fh.read(), re.MULTILINE).group(1))

    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        before = status("VmRSS")
    except OSError:
        return None
    fn()
    return (status("VmHWM") - before) * 1024


def down_and_assert_clean(topo, also: set[int] | frozenset[int] = frozenset()) -> None:
    """Teardown of a deployment test: stop the topology, then assert that no process it started
    (nor any it spawned, nor the pids in ``also``, e.g. ones a test killed by hand) is alive."""
    from fl_geo.deploy import lifecycle, processes

    records = processes.load_records(topo)
    family = {r.pid for r in records} | processes._descendants(r.pid for r in records if r.alive())
    res = lifecycle.down(topo, grace_s=5)
    assert not res.survivors, f"still alive after down: {res.survivors}"
    alive = [pid for pid in family | set(also) if processes._alive(pid)]
    assert not alive, f"processes left behind: {alive}"
    assert not topo.pids_path.exists()


def fail_train_on(grid, node: int, reason: str = "the site's accelerator is gone") -> None:
    """Make ``node``'s ClientApp raise on every train message of ``grid`` (an InlineGrid): its
    jobs become error replies, as a site whose training crashes gives."""
    inner = grid.client_app

    def app(msg, context):
        if msg.metadata.dst_node_id == node and msg.metadata.message_type == "train":
            raise RuntimeError(reason)
        return inner(msg, context)

    grid.client_app = app


def site_reply_hook(partition: int, *, tokens=None, scale: float | None = None):
    """A reply hook for an InlineGrid: the train replies of the site of ``partition`` claim
    ``tokens`` (when given) and carry their arrays × ``scale`` (when given; an fp32 wire)."""
    import numpy as np
    from flwr.app import Array, ArrayRecord, Message, MetricRecord

    def hook(node, msg, reply):
        if msg.metadata.message_type != "train" or reply.has_error():
            return reply
        metrics = dict(reply.content.metric_records["metrics"])
        if metrics["partition_id"] != partition:
            return reply
        if tokens is not None:
            metrics["tokens"] = tokens
        arrays = reply.content.array_records["arrays"]
        if scale is not None:
            arrays = ArrayRecord({k: Array(a.numpy() * np.float32(scale)) for k, a in arrays.items()})
        return Message(keep_declaration(reply, {"arrays": arrays, "metrics": MetricRecord(metrics)}), reply_to=msg)

    return hook


class ServerCrash(RuntimeError):
    """The ServerApp dies (raised by `crash_hook` from inside its pull loop)."""


def crash_hook(nth: int, message_type: str = "train", round_no: int | None = None):
    """A reply hook for an InlineGrid that kills the server when it pulls the ``nth`` reply of
    ``message_type`` (of round ``round_no`` only, when given): the node has already run the job
    (its state moved on), the server never sees the reply. Raises `ServerCrash`."""
    seen = {"n": 0}

    def hook(node, msg, reply):
        cfg = msg.content.config_records.get("fl-geo")
        if msg.metadata.message_type != message_type:
            return reply
        if round_no is not None and (cfg is None or int(cfg.get("round", -1)) != round_no):
            return reply
        seen["n"] += 1
        if seen["n"] == nth:
            raise ServerCrash(f"server killed at {message_type} reply {nth}"
                              + ("" if round_no is None else f" of round {round_no}"))
        return reply

    return hook


def partition_reply_hook(partition: int, change, message_type: str = "train"):
    """A reply hook for an InlineGrid: the ``message_type`` replies (``train``, or
    ``train.stream`` for the streaming loops) of the site of ``partition`` pass through
    ``change(n, reply, msg, earlier)`` (n: the site's reply count from 1; earlier: its replies so
    far, oldest first); error replies and other sites' replies pass untouched. ``hook.changed``
    counts the replies ``change`` altered (returned something other than ``reply``)."""
    earlier = []

    def hook(node, msg, reply):
        if msg.metadata.message_type != message_type or reply.has_error():
            return reply
        if reply.content.metric_records["metrics"]["partition_id"] != partition:
            return reply
        earlier.append(reply)
        out = change(len(earlier), reply, msg, earlier[:-1])
        hook.changed += out is not reply
        return out

    hook.changed = 0
    return hook



@pytest.fixture
def flower_task_identity(monkeypatch):
    """A Flower task identity for tests that build Messages outside a running app.

    ``Message(...)`` reads the process's ``TaskIdentity`` (run id), which only a running Flower app
    (or the in-process grid) sets; a test that relied on an earlier test having set it would pass
    or fail depending on the order the workers draw tests in."""
    from flwr.supercore.task_identity import TaskIdentity

    for attr in ("_task_id", "_run_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)
