"""Compression beyond the sites' uplink: HALoS's local server -> global server update
(``halos.compress``, error feedback per local server) and the Streaming DiLoCo / CoCoDC fragments
(``wire.compress`` per fragment, error feedback per fragment per site; ``streaming.quantize`` its
alias). docs/compression.md."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from fl_geo.clients.stream import STREAM_RESIDUAL_KEY
from fl_geo.config import ConfigError, uplink_wire
from fl_geo.core.compress import Compressor, CompressSettings, payload_nbytes
from fl_geo.core.halos import GlobalParameterServer, LocalParameterServer
from fl_geo.core.state import ParamSpec
from fl_geo.halos.apps import apply_region_update
from fl_geo.runtime.compressed import compress_record, read_update_record
from fl_geo.runtime.metrics import read_metrics
from fl_geo.scenario_files import load_scenario
from fl_geo.strategies.client_record import client_config_record
from fl_geo.timing.cost import CostModel
from tests.test_compressed_uplink import HALOS, NPY_HEADER, NUMEL, _run, _topk_bytes

TOPK = CompressSettings(codec="topk", ratio=0.01, values="int2", error_feedback=True)
N = 5000  # the unit tests' model: two chunks of 4096 (the second one short)


def _lps(n: int = N) -> LocalParameterServer:
    return LocalParameterServer(torch.zeros(n), lr=1.0, momentum=0.0, buffer_size=1, accumulate=1, alpha=0.5)


def _step(lps: LocalParameterServer, seed: int) -> torch.Tensor:
    """One worker update, then U_k as the LPS would send it uncompressed (not marked sent)."""
    lps.apply(torch.randn(lps.numel, generator=torch.Generator().manual_seed(seed)))
    return torch.sub(lps.merged_params, lps.params)


# ---- the local server's compressed send ---------------------------------------------------------


def test_lps_payload_round_trip_and_residual_recursion():
    """e_1 = U_1 − Û_1, e_2 = U_2 + e_1 − Û_2 (by hand), through the record the GPS reads; the
    residual is part of the LPS's snapshot, and a snapshot without it restores a zero one."""
    comp = Compressor(TOPK)
    spec = ParamSpec.from_state_dict({"w": torch.zeros(N)})
    lps = _lps()
    u1 = _step(lps, 1)
    record = compress_record(lps.make_compressed_update(comp))
    assert sum(a.numpy().nbytes for a in record.values()) == payload_nbytes(TOPK, N)
    u1_hat = read_update_record(record, spec, "fp32", comp)
    assert lps.outstanding and lps.sends == 1
    assert (u1_hat != 0).sum() <= 2 * 41
    torch.testing.assert_close(lps.residual, u1 - u1_hat, rtol=0, atol=0)
    lps.merge(torch.zeros(N))
    u2 = _step(lps, 2)
    u2_hat = read_update_record(compress_record(lps.make_compressed_update(comp)), spec, "fp32", comp)
    torch.testing.assert_close(lps.residual, u2 + (u1 - u1_hat) - u2_hat, rtol=0, atol=1e-6)

    snap = lps.snapshot()
    other = _lps()
    other.restore(snap)
    assert torch.equal(other.residual, lps.residual) and other.residual.data_ptr() != lps.residual.data_ptr()
    del snap["residual"]  # a restarted LPS without it starts from zero, by rule
    other.restore(snap)
    assert other.residual is None
    snap["residual"] = torch.full((N,), float("nan"))
    with pytest.raises(ValueError, match="residual"):
        other.restore(snap)


def test_lps_without_error_feedback_keeps_no_residual():
    lps = _lps()
    _step(lps, 1)
    lps.make_compressed_update(Compressor(CompressSettings(codec="int8", error_feedback=False)))
    assert lps.residual is None and lps.snapshot()["residual"] is None


def _bad_index(arrays):
    arrays["indices"][-1] = 4095  # the short last chunk holds 904 elements


def _nan_scale(arrays):
    arrays["scales"][0] = np.nan


def _missing(arrays):
    del arrays["scales"]


@pytest.mark.parametrize("change", [_bad_index, _nan_scale, _missing], ids=["index-out-of-range", "nan-scale",
                                                                            "missing-array"])
def test_a_hostile_lps_payload_is_refused_with_the_global_model_unchanged(change):
    comp = Compressor(TOPK)
    spec = ParamSpec.from_state_dict({"w": torch.zeros(N)})
    gps = GlobalParameterServer(torch.randn(N, generator=torch.Generator().manual_seed(0)), lr=0.5, momentum=0.5,
                                buffer_size=1)
    before = gps.snapshot()
    lps = _lps()
    _step(lps, 3)
    good = compress_record(lps.make_compressed_update(comp))
    arrays = {k: a.numpy().copy() for k, a in good.items()}
    change(arrays)
    why = apply_region_update(gps, ArrayRecord({k: Array(v) for k, v in arrays.items()}), spec, "fp32", comp)
    assert why is not None and "\n" not in why
    assert gps.version == 0 and torch.equal(gps.params, before["params"])
    assert apply_region_update(gps, good, spec, "fp32", comp) is None and gps.version == 1


# ---- HALoS in simulation: bytes, clock, refusals --------------------------------------------------

TIER2 = ["halos.compress=topk", "halos.compress_ratio=0.01", "halos.compress_values=int2"]


def test_halos_charges_and_counts_the_compressed_global_updates(tiny, tmp_path):
    """Each global update crosses the inter-region link as the payload (562 bytes + one .npy header
    per array, counted) and is charged as the payload of the scenario's modelled model: the run's
    virtual time is shorter than with U_k in fp32 by at least one compressed transfer."""
    plain, _, _ = _run(tiny(*HALOS), tmp_path, "plain")
    comp, final, _ = _run(tiny(*HALOS, *TIER2), tmp_path, "comp")
    assert comp["outer_steps"] == 3 and comp["rejected"] == 0 and torch.isfinite(final).all()
    per_send = _topk_bytes() + 3 * NPY_HEADER
    rows = read_metrics(tmp_path / "comp")[1:]
    totals = [r["halos/bytes_to_global_total"] for r in rows]
    assert totals[:3] == [per_send, 2 * per_send, 3 * per_send] and totals[-1] % per_send == 0
    assert comp["halos_bytes_to_global"] == totals[-1]
    # the plain run's global updates: fp32 models (wire.up)
    plain_total = read_metrics(tmp_path / "plain")[-1]["halos/bytes_to_global_total"]
    assert plain_total > 0 and plain_total % (4 * NUMEL) == 0
    scenario = load_scenario("dips_eta100")
    modelled = scenario.modelled_params(fallback=NUMEL)
    cost = CostModel(NUMEL, scenario)
    src = scenario.node_region(1)
    hand = payload_nbytes(TOPK, modelled)  # indices, int2 codes and scales of the modelled model
    assert cost.transfer_s(src, scenario.server_region, "fp32", compress=TOPK) == pytest.approx(
        scenario.transfer_time(src, scenario.server_region, hand))
    assert comp["virtual_s"] < plain["virtual_s"]


def test_halos_simulation_refuses_a_malformed_global_update(tiny, tmp_path, monkeypatch):
    """The first U_k arrives with a NaN scale: refused, counted, θ_g unchanged by it; the local
    server still gets θ_g back and the run reaches its budget."""
    import fl_geo.strategies.halos as halos_loop

    sent = []

    def hostile(payload):
        record = compress_record(payload)
        sent.append(1)
        if len(sent) > 1:
            return record
        arrays = {k: a.numpy().copy() for k, a in record.items()}
        _nan_scale(arrays)
        return ArrayRecord({k: Array(v) for k, v in arrays.items()})

    monkeypatch.setattr(halos_loop, "compress_record", hostile)
    summary, final, _ = _run(tiny(*HALOS, *TIER2), tmp_path, "h")
    rows = read_metrics(tmp_path / "h")
    assert summary["outer_steps"] == 3 and summary["rejected"] == 1 and torch.isfinite(final).all()
    assert rows[-1]["halos/global_rejected_total"] == 1 and len(sent) == 4


@pytest.mark.parametrize(("overrides", "message"), [
    (["halos.compress=zstd"], "halos.compress must be one of"),
    (["halos.compress=topk", "halos.compress_ratio=0"], "halos.compress_ratio must be in (0, 1]"),
    (["halos.compress=topk", "halos.error_feedback_decay=2"], "halos.error_feedback_decay must be in (0, 1]"),
    (["halos.compress=int8", "halos.compress_block=0"], "halos.compress_block must be an int >= 1"),
    (["streaming.quantize=int8", "wire.compress=topk", "strategy.name=streaming_diloco", "model.n_layers=2"],
     "alias of wire.compress=int8 wire.compress_block=128 wire.error_feedback=false; set wire.compress only"),
])
def test_config_refuses(tiny, overrides, message):
    with pytest.raises(ConfigError) as info:
        tiny(*overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


# ---- streaming fragments ----------------------------------------------------------------------------

STREAM = ["strategy.name=streaming_diloco", "model.n_layers=2", "strategy.inner_steps=4", "streaming.fragments=2",
          "streaming.overlap=1", "run.num_clients=2"]


def test_streaming_quantize_is_an_alias_of_wire_compress(tiny):
    cfg = tiny(*STREAM, "streaming.quantize=int4", "streaming.quantize_block=64")
    wire = uplink_wire(cfg)
    assert (wire.compress, wire.compress_block, wire.error_feedback) == ("int4", 64, False)
    assert cfg.wire.compress == "none"  # the config itself is as written
    assert '"codec": "int4"' in client_config_record(cfg)["wire_compress"]
    assert "wire_compress" not in client_config_record(tiny(*STREAM))


def test_streaming_fragments_compressed_with_error_feedback_learn(tiny, tmp_path):
    """Top-k 10 % + int2 + EF per fragment: every site keeps one residual per fragment it synced
    (of that fragment's size), the payloads are the compressed ones, and the model learns."""
    cfg = tiny(*STREAM, "run.rounds=3", "wire.compress=topk", "wire.compress_ratio=0.1", "run.eval_every=1")
    seen: dict[str, list[int]] = {}

    def hook(node, msg, reply):
        for key, record in reply.content.array_records.items():
            if key.startswith("frag_"):
                seen.setdefault(key, []).append(sum(a.numpy().nbytes for a in record.values()))
        return reply

    summary, final, grid = _run(cfg, tmp_path, "s", hook=hook)
    rows = read_metrics(tmp_path / "s")
    assert summary["rejected"] == 0 and torch.isfinite(final).all()
    assert rows[-1]["val/loss"] < rows[0]["val/loss"] - 0.05, (rows[0]["val/loss"], rows[-1]["val/loss"])
    from fl_geo.core.streaming import Fragments

    spec = ParamSpec.from_json(torch.load(tmp_path / "s" / "final_model.pt")["spec"])
    frags = Fragments(spec, 2)
    settings = CompressSettings(codec="topk", ratio=0.1)
    assert sorted(seen) == ["frag_0", "frag_1"]
    for p in (0, 1):  # every payload is the fragment's compressed size (3 arrays: indices, codes, scales)
        assert set(seen[f"frag_{p}"]) == {payload_nbytes(settings, frags.numel(p))}
    for ctx in grid.contexts.values():
        kept = ctx.state.array_records[STREAM_RESIDUAL_KEY]
        assert sorted(kept.keys()) == ["0", "1"]
        for p in (0, 1):
            residual = kept[str(p)].numpy()
            assert residual.shape == (frags.numel(p),) and np.abs(residual).sum() > 0
