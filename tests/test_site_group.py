"""The persistent site group (fl_geo.clients.site_group, .site_daemon, fl_geo.inner.site_rank): one
daemon with two gloo ranks trains round after round with the numbers of one process with the whole batch (which
tests/test_distributed.py ties to the spawn-per-message job), keeps its ranks across rounds, fails
only the job in which a rank dies, is replaced when stale, and leaves no process behind.

Process starts cost ~3 s of CPU each here, so the file shares one daemon across its tests (module
fixture) and starts 9 processes in all: the daemon and its 2 ranks, 2 ranks again after the kill,
a daemon (no ranks) that replaces it, and a daemon with 2 FSDP ranks for the ClientApp's run. The
ranks unpickle the hooks and data of this module, so it imports no more than they need."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from fl_geo.clients.site_group import SiteGroup, SiteGroupTrainer, _gone
from fl_geo.core.state import ParamSpec, flatten
from fl_geo.data import BatchSampler, ByteTokenizer
from fl_geo.inner.distributed import DistributedTrainingError, config_model
from fl_geo.inner.model import ModelConfig, build_model
from fl_geo.inner.training import InnerConfig, InnerTrainer

# One xdist group (the module fixture's daemon); each CPU test states its wall time in a full
# `make test` for the lanes (tests/conftest.py).
pytestmark = pytest.mark.xdist_group("site-group")

TINY = ModelConfig(n_layers=1, d_model=32, n_heads=2, max_seq_len=32)
TOKENS = torch.from_numpy(ByteTokenizer().encode("the quick brown fox jumps over the lazy dog. " * 200))
B, SEQ, STEPS = 4, 16, 3  # per-rank batch, sequence length, steps per round
CPU2 = [torch.device("cpu")] * 2
FACTORY = functools.partial(config_model, TINY)
SEEN: set[int] = set()  # every daemon and rank pid the tests met: all must be gone at the end


def _inner(batch_size: int = B) -> InnerConfig:
    return InnerConfig(batch_size=batch_size, seq_len=SEQ, warmup_steps=2, total_steps=20, device="cpu")


def _sampler(batch_size: int) -> BatchSampler:
    return BatchSampler(TOKENS, SEQ, batch_size, seed=3, stream=1)


def _spec() -> ParamSpec:
    return ParamSpec.from_state_dict(build_model(TINY, 0).state_dict())


def _kill_rank_1(rank: int, world: int) -> None:
    """Rank 1 dies by SIGKILL once the job is under way (rank 0 is then blocked in its first all-reduce)."""
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """One daemon for the file; at the end it is stopped and every process it ever had must be gone."""
    torch.set_num_threads(1)
    address = f"unix://{tmp_path_factory.mktemp('site')}/g.sock"
    handle = SiteGroup(address, {"test": "site-group"}, CPU2, "gloo", timeout_s=60)
    yield handle
    info = handle.hello()
    if info is not None:
        SEEN.update([info["pid"], *info["ranks"]])
    handle.stop()
    assert handle.hello() is None
    assert SEEN and all(_gone(pid) for pid in SEEN), f"left behind: {[p for p in SEEN if not _gone(p)]}"


def _round(group: SiteGroup, params: torch.Tensor, opt: dict, start: int, **options) -> tuple:
    """One job through the group, as the ClientApp does it: state in, train, state out, release."""
    trainer = SiteGroupTrainer(group, FACTORY, _inner(), _spec(), join_timeout_s=120, **options)
    try:
        trainer.params.copy_(params)
        trainer.load_optimizer_state(opt)
        result = trainer.train(_sampler(B), STEPS, start)
        info = trainer.info
        SEEN.update([info["pid"], *info["ranks"]])
        return result, trainer.params.clone(), {k: v.clone() for k, v in trainer.optimizer_state().items()}, info
    finally:
        trainer.release()


@pytest.mark.slow(seconds=38)
def test_group_trains_three_rounds_like_one_process_and_keeps_its_ranks(group) -> None:
    reference = InnerTrainer(build_model(TINY, 0), _inner(2 * B))
    spec = _spec()
    params, opt, infos = flatten(reference.model.state_dict(), spec), {}, []
    for rnd in range(3):
        expected = reference.train(_sampler(2 * B), STEPS, rnd * STEPS)
        before = (params, opt)
        got, params, opt, info = _round(group, params, opt, rnd * STEPS)
        infos.append(info)
        assert got.steps == expected.steps == STEPS and got.tokens == expected.tokens == 2 * B * SEQ * STEPS
        assert got.mean_loss == pytest.approx(expected.mean_loss, rel=1e-5)
        torch.testing.assert_close(params, flatten(reference.model.state_dict(), spec), rtol=0, atol=1e-6)
        want = reference.optimizer_state()
        assert set(opt) == set(want)
        for key, value in want.items():
            torch.testing.assert_close(opt[key], value, rtol=0, atol=1e-7, msg=key)
    # A resumed server sends round 3 again and the node rewinds its state (rewind_to_round): the
    # group keeps no values of its own, so the same round from the same state gives the same bits.
    _, again, opt_again, info = _round(group, *before, 2 * STEPS)
    infos.append(info)
    torch.testing.assert_close(again, params, rtol=0, atol=0)
    assert all(torch.equal(opt_again[k], v) for k, v in opt.items())
    # One daemon and one set of ranks served all four jobs.
    assert len({i["pid"] for i in infos}) == 1 and len({tuple(i["ranks"]) for i in infos}) == 1
    assert len(infos[0]["ranks"]) == 2
    # The daemon only passes bytes: it never loaded torch (its ranks come from a fork server that did).
    maps = {pid: Path(f"/proc/{pid}/maps").read_text() for pid in (info["pid"], *info["ranks"])}
    assert "libtorch" not in maps[info["pid"]] and all("libtorch" in maps[r] for r in info["ranks"])


@pytest.mark.slow(seconds=19)
def test_a_killed_rank_fails_only_its_job_and_the_next_round_trains(group) -> None:
    params, start = flatten(build_model(TINY, 0).state_dict(), _spec()), 0
    before = group.ensure()
    with pytest.raises(DistributedTrainingError, match=r"(?s)rank 1 of the site group died.*SIGKILL"):
        _round(group, params, {}, start, rank_setup=_kill_rank_1)
    after_failure = group.hello()
    assert after_failure["pid"] == before["pid"] and after_failure["ranks"] == []  # the group was ended
    assert all(_gone(pid) for pid in before["ranks"])
    # The next job gets a fresh group and trains what one process with the whole batch trains.
    reference = InnerTrainer(build_model(TINY, 0), _inner(2 * B))
    expected = reference.train(_sampler(2 * B), STEPS, start)
    got, trained, _, info = _round(group, params, {}, start)
    assert info["pid"] == before["pid"] and len(info["ranks"]) == 2 and set(info["ranks"]).isdisjoint(before["ranks"])
    assert got.mean_loss == pytest.approx(expected.mean_loss, rel=1e-5)
    torch.testing.assert_close(trained, flatten(reference.model.state_dict(), _spec()), rtol=0, atol=1e-6)


def _report_and_stall_rank_1(folder: str, rank: int, world: int) -> None:
    """Each rank writes its pid; rank 1 then stalls, so rank 0 waits in the job's first collective."""
    Path(folder, f"rank-{rank}.pid").write_text(str(os.getpid()))
    if rank == 1:
        time.sleep(600)


@pytest.mark.slow(seconds=15)
def test_the_ranks_end_with_a_daemon_killed_mid_job(tmp_path) -> None:
    """SIGKILL the daemon (an OOM kill) while rank 0 waits in a collective for rank 1: both ranks
    end within seconds, not after the collective's timeout (60 s here) or rank 1's stall. Their
    parent is the fork server, which outlives the daemon while they run, so each rank watches the
    daemon itself (`GroupSetup.owner_pid`, `fl_geo.fork_server.die_with`)."""
    handle = SiteGroup(f"unix://{tmp_path}/k.sock", {"test": "daemon killed mid-job"}, CPU2, "gloo", timeout_s=60)
    daemon = handle.ensure()["pid"]
    params = flatten(build_model(TINY, 0).state_dict(), _spec())
    failed: list[BaseException] = []

    def job() -> None:
        try:
            _round(handle, params, {}, 0, rank_setup=functools.partial(_report_and_stall_rank_1, str(tmp_path)))
        except BaseException as exc:  # noqa: BLE001 - the job must fail; the test checks that below
            failed.append(exc)

    worker = threading.Thread(target=job, daemon=True)
    worker.start()
    files = [tmp_path / f"rank-{r}.pid" for r in range(2)]
    ranks: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not all(f.is_file() and f.read_text() for f in files):
            assert time.monotonic() < deadline and worker.is_alive(), f"the ranks did not start the job: {failed}"
            time.sleep(0.1)
        ranks = [int(f.read_text()) for f in files]
        time.sleep(1.0)  # rank 0 is in its first collective by now (it need not be for the claim)
        os.kill(daemon, signal.SIGKILL)
        killed = time.monotonic()
        while not all(_gone(pid) for pid in ranks):
            assert time.monotonic() - killed < 15, f"ranks still alive 15 s after their daemon: {ranks}"
            time.sleep(0.1)
        worker.join(60)
        assert not worker.is_alive() and failed, "the job outlived its daemon"
    finally:
        for pid in ranks:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        handle.stop()


@pytest.mark.slow(seconds=9)
def test_a_daemon_of_another_identity_is_replaced(group) -> None:
    old = group.ensure()
    other = SiteGroup(group.address, {"test": "another model"}, CPU2, "gloo", timeout_s=60)
    new = other.ensure()
    SEEN.update([old["pid"], *old["ranks"], new["pid"]])
    assert new["pid"] != old["pid"] and new["identity"] != old["identity"]
    assert _gone(old["pid"]) and all(_gone(pid) for pid in old["ranks"])


@pytest.mark.slow(seconds=49)
def test_client_app_trains_fsdp_through_the_node_site_group(tiny, tmp_path, group) -> None:
    """Through the real train handler, 2 rounds: node config devices=2 and site-group, with
    client.parallel=fsdp (FSDP2: each rank holds half of every tensor), activation checkpointing of
    every FSDP unit (recomputed inside the unit's gathered window) and batch 4, vs one process with
    batch 8 and no checkpointing. The ClientApp replaces the file's daemon (another run and model), and one daemon
    with one set of ranks serves both rounds. With the first test (DDP group = one process), this is
    FSDP2 = DDP on 2 ranks to fp32 rounding, each within the same bounds of the same reference."""
    from fl_geo.clients.datacenter import OPT_STATE_KEY
    from fl_geo.clients.datacenter import app as client_app
    from fl_geo.runtime.inline import InlineGrid
    from fl_geo.server_app import run_server

    stale = group.ensure()
    common = ("run.num_clients=1", "run.rounds=2", "strategy.inner_steps=2", "run.eval_every=0", "run.threads_per_client=1")
    runs = {}
    for name, batch, node in (("one", 8, {}), ("group", 4, {"devices": 2, "device": "cpu", "site-group": group.address})):
        cfg = tiny(*common, f"client.batch_size={batch}", f"strategy.site_devices={node.get('devices', 0)}",
                   "client.parallel=fsdp",  # one process: ignored (no ranks to shard over)
                   f"client.activation_checkpointing={str(bool(node)).lower()}")
        grid = InlineGrid(client_app, 1, seed=0, node_configs=[{"partition-id": 0, "num-partitions": 1, **node}])
        summary = run_server(grid, cfg, tmp_path / name)
        (context,) = grid.contexts.values()
        runs[name] = (summary, torch.load(tmp_path / name / "final_model.pt")["params"],
                      context.state.array_records[OPT_STATE_KEY])
    info = group.hello()
    SEEN.update([stale["pid"], *stale["ranks"], info["pid"], *info["ranks"]])
    assert info["pid"] != stale["pid"] and _gone(stale["pid"])
    assert info["jobs"] == 2 and info["generation"] == 1 and len(info["ranks"]) == 2  # ranks started once
    (s1, final1, opt1), (s2, final2, opt2) = runs["one"], runs["group"]
    assert s1["tokens"] == s2["tokens"] == 2 * 2 * 8 * 32
    torch.testing.assert_close(final2, final1, rtol=0, atol=1e-6)
    assert list(opt2.keys()) and set(opt2.keys()) == set(opt1.keys())
    for key in opt1:
        torch.testing.assert_close(torch.from_numpy(opt2[key].numpy()), torch.from_numpy(opt1[key].numpy()),
                                   rtol=0, atol=1e-7, msg=key)


@pytest.mark.gpu
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_cuda_group_trains_two_rounds_like_one_process(parallel, tmp_path) -> None:
    """make gpu-check: the site group on up to 2 GPUs (NCCL), DDP and FSDP2, fp32 so that the
    numbers can be compared with one process holding the whole batch; the ranks persist."""
    ranks = min(2, torch.cuda.device_count())
    devices = [torch.device("cuda", r) for r in range(ranks)]
    handle = SiteGroup(f"unix://{tmp_path}/gpu.sock", {"test": f"gpu-{parallel}"}, devices, "nccl", timeout_s=120)
    inner = InnerConfig(batch_size=B, seq_len=SEQ, warmup_steps=2, total_steps=20, device="cuda", precision="fp32")
    reference = InnerTrainer(build_model(TINY, 0), dataclasses.replace(inner, batch_size=ranks * B))
    params, opt, pids = flatten(build_model(TINY, 0).state_dict(), _spec()), {}, set()
    try:
        for rnd in range(2):
            expected = reference.train(_sampler(ranks * B), STEPS, rnd * STEPS)
            trainer = SiteGroupTrainer(handle, FACTORY, inner, _spec(), join_timeout_s=300, parallel=parallel)
            try:
                trainer.params.copy_(params)
                trainer.load_optimizer_state(opt)
                got = trainer.train(_sampler(B), STEPS, rnd * STEPS)
                params = trainer.params.clone()
                opt = {k: v.clone() for k, v in trainer.optimizer_state().items()}
                pids.add((trainer.info["pid"], tuple(trainer.info["ranks"])))
            finally:
                trainer.release()
            assert got.mean_loss == pytest.approx(expected.mean_loss, rel=1e-4)
            want = flatten({k: v.cpu() for k, v in reference.model.state_dict().items()}, _spec())
            torch.testing.assert_close(params, want, rtol=0, atol=1e-5)
        assert len(pids) == 1  # one daemon, one set of ranks for both rounds
        memory = handle.hello()["memory"]
        assert len(memory) == ranks and all(m["peak_device_mib"] > 0 for m in memory)
    finally:
        handle.stop()
