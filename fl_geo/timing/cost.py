"""The cost model: what a job sends, and how long the modelled WAN takes to carry it.

Every outer loop (synchronous, asynchronous, streaming, HALoS, the sharded parameter server)
and the wall-clock fault planner ask the same questions: how many bytes does a model-sized
payload take at a wire precision, and how long do a job, a transfer or a ring all-reduce take
on the scenario. They ask one :class:`CostModel`, so the answers cannot drift apart.

Two byte counts, deliberately different:

- :meth:`CostModel.sent_bytes`: the *trained* model's payload, what actually crosses the wire.
  The byte counters (``comm/bytes_up``, ``summary.json``) report it.
- :meth:`CostModel.charged_bytes`: what the virtual clock charges: the scenario's *modelled*
  model (``model.num_params``, e.g. Pythia-70M's 70 M parameters for a proxy a thousand times
  smaller), so the communication/compute ratio is the paper's; the trained model's count when
  the scenario models none, or when there is no scenario (a wall clock measures, it charges
  nothing, but the count still sizes the job for the dispatcher). An update compressed by
  ``wire.compress`` is charged as the compressed payload of the modelled model
  (:meth:`CostModel.charged_up_bytes`; a streaming fragment as that of its share), and so is a
  HALoS local server's update compressed by ``halos.compress`` (:meth:`CostModel.transfer_s`);
  the model a job sends down, with ``wire.compress_down``, as the compressed delta(s) it carries
  or the whole model (:meth:`CostModel.charged_down_bytes`).

Framework-free: no Flower, no omegaconf; the scenario answers the link and speed questions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fl_geo.timing.scenario import JobTime, Scenario, payload_bytes

if TYPE_CHECKING:
    from fl_geo.core.compress import CompressSettings


@dataclass(frozen=True)
class CostModel:
    """Bytes and modelled times of one run's jobs.

    ``numel``: the trained model's parameter count. ``scenario``: the modelled hardware and WAN
    (None with a wall clock: every time is then 0 and ``charged_bytes == sent_bytes``).
    """

    numel: int
    scenario: Scenario | None = None
    # wire.compress: the uplink's compression (None: the uplink is a model-sized payload at wire.up)
    uplink: CompressSettings | None = None
    # wire.compress_down: the downlink's compression (None: the whole model at wire.down, always)
    downlink: CompressSettings | None = None
    # the sharded PS's data path with wire.compress: the update goes as one payload per shard of
    # these trained-parameter counts (chunks restart at every shard), () = one payload
    up_shards: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.numel < 0:
            raise ValueError(f"numel must be >= 0, got {self.numel}")

    @property
    def modelled_params(self) -> int:
        """The parameter count the clock charges for: the scenario's, else the trained model's."""
        if self.scenario is None:
            return self.numel
        return self.scenario.modelled_params(fallback=self.numel)

    # ---- bytes ----------------------------------------------------------------------------------
    def sent_bytes(self, precision: str) -> int:
        """Bytes of the trained model's payload (model or pseudo-gradient) at a wire precision."""
        return payload_bytes(precision, self.numel)

    def charged_bytes(self, precision: str) -> int:
        """Bytes the virtual clock charges for one model-sized payload at a wire precision."""
        return payload_bytes(precision, self.modelled_params)

    def _modelled_share(self, share_numel: int) -> int:
        if not 0 <= share_numel <= self.numel:
            raise ValueError(f"a share of {share_numel} parameters is not part of a {self.numel}-parameter model")
        return round(self.modelled_params * share_numel / self.numel) if self.numel else 0

    def charged_share_bytes(self, share_numel: int, precision: str) -> int:
        """Bytes charged for a part of the model (a Streaming DiLoCo fragment of ``share_numel``
        trained parameters): its share of the modelled model at the wire precision, or the
        compressed payload of that share with ``uplink`` (``wire.compress``, or
        ``streaming.quantize``'s alias of it)."""
        if self.uplink is not None:
            return self.charged_compressed_bytes(self.uplink, share_numel)
        return payload_bytes(precision, self._modelled_share(share_numel))

    def charged_up_bytes(self, wire_up: str) -> int:
        """Bytes the virtual clock charges for one update (a site's pseudo-gradient): the compressed
        payload of the modelled model with ``uplink`` (`fl_geo.core.compress.payload_nbytes`, the
        arrays' bytes; with ``up_shards``, the sum of each shard's share's payload), else a
        model-sized payload at ``wire_up``."""
        if self.uplink is None:
            return self.charged_bytes(wire_up)
        if self.up_shards:
            return sum(self.charged_compressed_bytes(self.uplink, n) for n in self.up_shards)
        return self.charged_compressed_bytes(self.uplink)

    def charged_compressed_bytes(self, settings: CompressSettings, share_numel: int | None = None) -> int:
        """Bytes charged for a compressed payload of the modelled model (or of its share of
        ``share_numel`` trained parameters): `fl_geo.core.compress.payload_nbytes`, the arrays' bytes."""
        from fl_geo.core.compress import payload_nbytes as compressed_nbytes

        n = self.modelled_params if share_numel is None else self._modelled_share(share_numel)
        return compressed_nbytes(settings, n) if n else 0

    def charged_down_bytes(self, wire_down: str, deltas: int | None = None) -> int:
        """Bytes the virtual clock charges for the model a job is sent: ``deltas`` compressed
        downlink payloads of the modelled model (`fl_geo.core.downlink`: 0 for a site already up
        to date), or with ``deltas`` None (and always without ``downlink``) the whole model at
        ``wire_down``."""
        if deltas is None or self.downlink is None:
            return self.charged_bytes(wire_down)
        if deltas < 0:
            raise ValueError(f"deltas must be >= 0, got {deltas}")
        return deltas * self.charged_compressed_bytes(self.downlink)

    def job_bytes(self, wire_down: str, wire_up: str, deltas: int | None = None) -> tuple[int, int]:
        """(down, up) bytes charged for one job: the model out (`charged_down_bytes`), the update
        back (compressed with ``uplink``, `charged_up_bytes`)."""
        return self.charged_down_bytes(wire_down, deltas), self.charged_up_bytes(wire_up)

    # ---- time -----------------------------------------------------------------------------------
    def job_time(self, slot: int, steps: int, wire_down: str, wire_up: str,
                 peer_region: str | int | None = None, start: float | None = None, deltas: int | None = None) -> JobTime:
        """A job's download, ``steps`` inner steps on node ``slot`` and upload, on the scenario
        (all zero without one). ``peer_region``: where the server it talks to sits. ``deltas``:
        the compressed downlink deltas the job carries (`charged_down_bytes`)."""
        if self.scenario is None:
            return JobTime(0.0, 0.0, 0.0)
        down, up = self.job_bytes(wire_down, wire_up, deltas)
        return self.scenario.job_time(slot, steps, down, up, peer_region, start=start)

    def transfer_s(self, src_region: str | int, dst_region: str | int, precision: str,
                   start: float | None = None, compress: CompressSettings | None = None) -> float:
        """One model-sized payload from ``src_region`` to ``dst_region`` (0 without a scenario):
        at ``precision``, or ``compress``'s payload of the modelled model (HALoS's local server
        to global server update with ``halos.compress``)."""
        if self.scenario is None:
            return 0.0
        nbytes = self.charged_bytes(precision) if compress is None else self.charged_compressed_bytes(compress)
        return self.scenario.transfer_time(src_region, dst_region, nbytes, start=start)

    def allreduce_s(self, slots: Sequence[int], nbytes: int, start: float | None = None) -> float:
        """A ring all-reduce of ``nbytes`` among the nodes ``slots`` (0 without a scenario)."""
        if self.scenario is None or not slots:
            return 0.0
        return self.scenario.allreduce_time(list(slots), nbytes, start=start)
