"""The compressed uplink (wire.compress): fl-geo's ClientApp sends its pseudo-gradient as a
`fl_geo.core.compress` payload with error feedback; the synchronous and asynchronous loops read it
(strategies/replies.py), count its bytes and charge them on the virtual clock (docs/compression.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message

from fl_geo.clients.datacenter import app as client_app
from fl_geo.clients.persist import EF_RESIDUAL_KEY
from fl_geo.config import ConfigError
from fl_geo.core.compress import Compressor, CompressSettings, payload_nbytes
from fl_geo.runtime.compressed import decompress_record
from fl_geo.runtime.inline import InlineGrid
from fl_geo.runtime.metrics import read_metrics
from fl_geo.scenario_files import load_scenario
from fl_geo.server_app import run_server
from fl_geo.timing.cost import CostModel
from tests.conftest import keep_declaration, site_reply_hook

NUMEL = 21_600  # the tiny model's parameters
NPY_HEADER = 128  # np.save's header of a 1-D array (magic, version, length, dict padded to 64 bytes)
TOPK = ["wire.compress=topk", "wire.compress_ratio=0.01", "wire.compress_values=int2", "wire.error_feedback=true"]
VIRTUAL = ["run.clock=virtual", "run.scenario=dips_eta100", "run.num_clients=4"]


def _run(cfg, tmp_path, name="run", hook=None, seed=0):
    grid = InlineGrid(client_app, cfg.run.num_clients, seed=seed)
    grid.reply_hook = hook
    summary = run_server(grid, cfg, tmp_path / name)
    return summary, torch.load(tmp_path / name / "final_model.pt")["params"], grid


def _topk_bytes() -> int:
    # 21,600 = 5 chunks of 4096 + one of 1120; k = round(0.01 * 4096) = 41 in each: m = 246 entries
    m = 6 * 41
    indices = 2 * m  # uint16 in-chunk indices
    codes = -(-m * 2 // 8)  # four 2-bit codes a byte
    scales = 4 * -(-m // 128)
    return indices + codes + scales  # 492 + 62 + 8


def _int8_bytes() -> int:
    return NUMEL + 4 * -(-NUMEL // 128)  # one byte a code, one fp32 scale per 128


def test_payload_bytes_by_hand():
    assert _topk_bytes() == 562 == payload_nbytes(CompressSettings(codec="topk"), NUMEL)
    assert _int8_bytes() == payload_nbytes(CompressSettings(codec="int8"), NUMEL)


@pytest.mark.parametrize(("wire", "nbytes", "arrays"), [(TOPK, _topk_bytes(), 3),
                                                        (["wire.compress=int8"], _int8_bytes(), 2)],
                         ids=["topk-int2-ef", "int8"])
def test_diloco_sends_and_counts_compressed_updates(tiny, tmp_path, wire, nbytes, arrays):
    summary, final, _ = _run(tiny("run.rounds=2", *wire), tmp_path)
    assert summary["num_params"] == NUMEL and summary["outer_steps"] == 2 and summary["rejected"] == 0
    assert np.isfinite(summary["final_train_loss"]) and np.isfinite(summary["final_val_loss"])
    assert torch.isfinite(final).all()
    per_update = nbytes + arrays * NPY_HEADER  # what travels: the arrays as .npy, as every payload is counted
    rows = read_metrics(tmp_path / "run")[1:]
    assert [r["comm/bytes_up"] for r in rows] == [3 * per_update] * 2
    assert summary["bytes_up"] == 2 * 3 * per_update


def test_the_clock_charges_the_compressed_bytes(tiny, tmp_path):
    """DiLoCo on a scenario: the exchange is a ring all-reduce of the update. The compressed run
    is faster by exactly the all-reduce of the fp32 model minus that of the compressed payload
    (of the scenario's modelled model) each round; the inner steps cost the same."""
    scenario = load_scenario("dips_eta100")
    rounds = 2
    plain, _, _ = _run(tiny(f"run.rounds={rounds}", *VIRTUAL), tmp_path, "plain")
    comp, _, _ = _run(tiny(f"run.rounds={rounds}", *VIRTUAL, *TOPK), tmp_path, "comp")
    modelled = scenario.modelled_params(fallback=NUMEL)
    settings = CompressSettings(codec="topk", ratio=0.01, values="int2")
    cost = CostModel(NUMEL, scenario, uplink=settings)
    assert cost.charged_up_bytes("fp32") == payload_nbytes(settings, modelled) < 4 * modelled / 100
    assert cost.job_bytes("fp32", "fp32") == (4 * modelled, payload_nbytes(settings, modelled))
    slots = [0, 1, 2, 3]
    saved = scenario.allreduce_time(slots, 4 * modelled) - scenario.allreduce_time(slots, payload_nbytes(settings, modelled))
    assert plain["virtual_s"] - comp["virtual_s"] == pytest.approx(rounds * saved, rel=1e-9)
    # the asynchronous loop's job: its upload is the compressed payload over the node's link
    job = cost.job_time(1, 3, "fp32", "fp32")
    fp32_job = CostModel(NUMEL, scenario).job_time(1, 3, "fp32", "fp32")
    assert job.compute == fp32_job.compute and job.down == fp32_job.down
    assert job.up == pytest.approx(scenario.job_time(1, 3, 4 * modelled, payload_nbytes(settings, modelled)).up)
    assert job.up < fp32_job.up


def _capture(store: dict, partition: int):
    def hook(node, msg, reply):
        if (msg.metadata.message_type == "train" and not reply.has_error()
                and reply.content.metric_records["metrics"]["partition_id"] == partition):
            store.setdefault("replies", []).append(reply.content.array_records["arrays"])
            store.setdefault("nodes", []).append(node)
        return reply
    return hook


def test_error_feedback_residual_is_delta_minus_what_was_sent(tiny, tmp_path):
    """After round 1 a site's residual is Δ − Δ̂: Δ̂ (what the server decoded) plus the residual
    is the true Δ, which the uncompressed run of the same seed sends in fp32 (round 1 starts from
    the same model in both runs, and training is deterministic)."""
    exact, compressed = {}, {}
    _run(tiny("run.rounds=1"), tmp_path, "exact", hook=_capture(exact, 1))
    _, _, grid = _run(tiny("run.rounds=1", *TOPK), tmp_path, "comp", hook=_capture(compressed, 1))
    from fl_geo.core.state import ParamSpec
    from fl_geo.runtime.wire import decode

    spec = ParamSpec.from_json(torch.load(tmp_path / "exact" / "final_model.pt")["spec"])
    delta = torch.cat([p.reshape(-1) for _, p in decode(exact["replies"][0], spec, "fp32")]).float()
    comp = Compressor(CompressSettings(codec="topk", ratio=0.01, values="int2"))
    sent = decompress_record(compressed["replies"][0], comp, NUMEL)
    residual = torch.from_numpy(grid.contexts[compressed["nodes"][0]].state.array_records[EF_RESIDUAL_KEY]["residual"].numpy())
    assert residual.shape == (NUMEL,) and residual.abs().sum() > 0
    assert (sent != 0).sum() <= 6 * 41  # top-k: most of Δ stayed behind, in the residual
    torch.testing.assert_close(sent + residual, delta, rtol=0, atol=1e-6)
    # what was not sent is exactly the residual: where an entry went out, only its rounding stays
    assert torch.equal(residual[sent == 0], delta[sent == 0])


def test_error_feedback_off_keeps_no_residual(tiny, tmp_path):
    _, _, grid = _run(tiny("run.rounds=1", "wire.compress=int8", "wire.error_feedback=false"), tmp_path)
    assert all(EF_RESIDUAL_KEY not in c.state.array_records for c in grid.contexts.values())


def test_fedbuff_with_compression_finishes(tiny, tmp_path):
    cfg = tiny(*VIRTUAL, "strategy.name=fedbuff", "run.rounds=4", *TOPK)
    summary, final, _ = _run(cfg, tmp_path)
    assert summary["outer_steps"] == 4 and summary["rejected"] == 0 and torch.isfinite(final).all()
    assert summary["bytes_up"] == summary["accepted_updates"] * (_topk_bytes() + 3 * NPY_HEADER)


def _tamper(partition: int, change):
    """Site ``partition``'s compressed train replies with their arrays passed through ``change``."""
    def hook(node, msg, reply):
        if msg.metadata.message_type != "train" or reply.has_error():
            return reply
        if reply.content.metric_records["metrics"]["partition_id"] != partition:
            return reply
        arrays = {k: a.numpy().copy() for k, a in reply.content.array_records["arrays"].items()}
        change(arrays)
        record = ArrayRecord({k: Array(v) for k, v in arrays.items()})
        return Message(keep_declaration(reply, {"arrays": record, "metrics": reply.content.metric_records["metrics"]}),
                       reply_to=msg)
    return hook


def _index_out_of_range(arrays):
    arrays["indices"][-1] = 4095  # the last, short chunk holds 1120 elements


def _nan_scale(arrays):
    arrays["scales"][0] = np.nan


def _missing_scales(arrays):
    del arrays["scales"]


@pytest.mark.parametrize("change", [_index_out_of_range, _nan_scale, _missing_scales],
                         ids=["index-out-of-range", "nan-scale", "missing-array"])
@pytest.mark.parametrize("strategy", [[], ["strategy.name=fedbuff", *VIRTUAL]], ids=["diloco", "fedbuff"])
def test_malformed_compressed_payload_is_rejected(tiny, tmp_path, change, strategy):
    """A hostile compressed reply is a PayloadError -> ReplyError: logged, counted, and the model
    is exactly the one of the run where that site's reply is refused for another reason."""
    cfg = tiny("run.rounds=2", *strategy, *TOPK)
    summary, final, _ = _run(cfg, tmp_path, "hostile", hook=_tamper(0, change))
    _, refused, _ = _run(cfg, tmp_path, "refused", hook=site_reply_hook(0, tokens=float("nan")))
    assert summary["rejected"] >= 1 and summary["outer_steps"] == 2
    assert torch.equal(final, refused)


HALOS = ["strategy.name=halos", "halos.accumulate=2", "halos.local_buffer=2", "strategy.delay_buffer=2",
         "strategy.inner_steps=2", "run.rounds=3", *VIRTUAL]


def test_halos_workers_send_compressed_updates_to_their_local_servers(tiny, tmp_path):
    """HALoS: each worker's update reaches its local server compressed (counted as sent, charged
    on the worker's upload); what a local server sends the global one is not (halos.compress=none). The
    uplink's share of the run's bytes is the workers' payloads, and the compressed run's virtual
    time is shorter, its uploads being 1/170 of fp32."""
    plain, _, _ = _run(tiny(*HALOS), tmp_path, "plain")
    comp, final, _ = _run(tiny(*HALOS, *TOPK), tmp_path, "comp")
    assert comp["outer_steps"] == plain["outer_steps"] == 3 and comp["rejected"] == 0
    assert torch.isfinite(final).all()
    sends = comp["bytes_up"] - comp["accepted_updates"] * (_topk_bytes() + 3 * NPY_HEADER)
    # what the local servers sent the global one: fp32 models (wire.up), one per global update
    # and any still in transfer when the run ended
    assert sends % (4 * NUMEL) == 0 and sends // (4 * NUMEL) >= 3, sends
    assert comp["virtual_s"] < plain["virtual_s"]


@pytest.mark.parametrize("change", [_index_out_of_range, _nan_scale], ids=["index-out-of-range", "nan-scale"])
def test_halos_refuses_a_malformed_compressed_update(tiny, tmp_path, change):
    cfg = tiny(*HALOS, *TOPK)
    summary, final, _ = _run(cfg, tmp_path, "hostile", hook=_tamper(0, change))
    _, refused, _ = _run(cfg, tmp_path, "refused", hook=site_reply_hook(0, tokens=float("nan")))
    assert summary["rejected"] >= 1 and torch.equal(final, refused)


def test_an_uncompressed_reply_is_refused_when_the_uplink_is_compressed(tiny, tmp_path):
    from flwr.app import ConfigRecord

    from fl_geo.runtime.protocol import REQUEST_RECORD

    def fp32_decl(node, msg, reply):
        if msg.metadata.message_type != "train" or reply.has_error():
            return reply
        if reply.content.metric_records["metrics"]["partition_id"] != 0:
            return reply
        reply.content.config_records[REQUEST_RECORD] = ConfigRecord(
            {**dict(reply.content.config_records[REQUEST_RECORD]), "payload": "pseudo_grad"})
        return reply

    cfg = tiny("run.rounds=2", *TOPK)
    summary, final, _ = _run(cfg, tmp_path, "mislabelled", hook=fp32_decl)
    _, refused, _ = _run(cfg, tmp_path, "refused", hook=site_reply_hook(0, tokens=float("nan")))
    assert summary["rejected"] == 2 and torch.equal(final, refused)


@pytest.mark.parametrize(("overrides", "message"), [
    (["wire.compress=zstd"], "wire.compress must be one of"),
    (["wire.compress=topk", "wire.compress_ratio=0"], "wire.compress_ratio must be in (0, 1]"),
    (["wire.compress=topk", "wire.compress_values=int3"], "wire.compress_values must be one of"),
    (["wire.compress=int8", "wire.compress_block=0"], "wire.compress_block must be an int >= 1"),
    (["wire.compress=dct_topk", "wire.compress_chunk=8192"], "wire.compress_chunk must be an int in [1, 4096]"),
    (["wire.compress=int8", "wire.up=bf16"], "replaces wire.up"),
    (["wire.compress=topk", "wire.error_feedback_decay=0"], "wire.error_feedback_decay must be in (0, 1]"),
    (["wire.compress=int2", "wire.error_feedback=false", "wire.error_feedback_decay=0.9"],
     "wire.error_feedback_decay=0.9 decays the error-feedback residual, but error feedback is off"),
    (["wire.compress=topk", "strategy.name=ddp"], "streaming loops and HALoS's workers only"),
    (["wire.compress=topk", "strategy.name=dips", "strategy.pseudo_grad_base=current"], "pseudo_grad_base=current"),
])
def test_config_refuses(tiny, overrides, message):
    with pytest.raises(ConfigError) as info:
        tiny(*overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_compress_none_sends_the_same_requests(tiny):
    """wire.compress=none adds nothing to a request (the bytes of every message are as before)."""
    from fl_geo.strategies.client_record import client_config_record

    assert "wire_compress" not in client_config_record(tiny())
    assert "wire_compress" in client_config_record(tiny(*TOPK))
    # the decay reaches the sites with the rest of the settings (their residual is theirs)
    sent = json.loads(client_config_record(tiny(*TOPK, "wire.error_feedback_decay=0.9"))["wire_compress"])
    assert sent["feedback_decay"] == 0.9


def test_resume_with_compression_is_bit_identical(tiny, tmp_path):
    """The residual is part of a site's inner state: a server killed after a site trained round 4
    and resumed from its checkpoint sends round 4 again, the site rewinds its residual with its
    optimizer (``checkpoint_step``), and the run ends on the bits of the uninterrupted one."""
    from tests.test_checkpoint import crash_and_resume

    common = ["run.rounds=5", "run.clock=virtual", "run.checkpoint_every=1", *TOPK]
    _, full, _ = _run(tiny(*common), tmp_path, "full")
    crash_and_resume(tiny, common, tmp_path / "resumed")
    assert torch.equal(full, torch.load(tmp_path / "resumed" / "final_model.pt")["params"])


def test_restarted_server_reloads_the_residual_from_disk(tiny, tmp_path):
    """A restarted ServerApp is a new Flower run (empty context.state): nodes with ``state-dir``
    reload the residual with the rest of their inner state, and the run stays bit-identical."""
    from tests.test_checkpoint import crash_and_restart_with_state_dirs

    common = ["run.rounds=4", "run.clock=virtual", "run.checkpoint_every=1", *TOPK]
    _, full, _ = _run(tiny(*common), tmp_path, "full")
    fresh = crash_and_restart_with_state_dirs(tiny, common, tmp_path, tmp_path / "r")
    assert torch.equal(full, torch.load(tmp_path / "r" / "final_model.pt")["params"])
    assert all(EF_RESIDUAL_KEY in c.state.array_records for c in fresh.contexts.values())


def test_compress_none_keeps_the_run_identity(tiny):
    """The compress keys enter a run's identity (its checkpoints' run id) only when compression is
    on: an uncompressed run keeps the run id it had before, so its checkpoints stay its own."""
    from fl_geo.config import run_identity

    assert not any(k.startswith(("wire.compress", "wire.error_feedback")) for k in run_identity(tiny()))
    assert run_identity(tiny(*TOPK))["wire.compress"] == "topk"
    assert run_identity(tiny(*TOPK)) != run_identity(tiny(*TOPK, "wire.compress_values=int4"))
    # decay 1 (plain EF, what every compressed run did before decay existed) keeps the run id too
    assert "wire.error_feedback_decay" not in run_identity(tiny(*TOPK))
    assert run_identity(tiny(*TOPK, "wire.error_feedback_decay=0.9"))["wire.error_feedback_decay"] == 0.9
