"""The ``run`` section: what to run, for how long, where its files go and which processes run it.

Its keys are read across the entry points (`fl_geo.simulation`, `fl_geo.server_app`, the runtime
session, `fl_geo.ray_cluster`), so the section has no single owning package and lives in this
module of its own. The checks that read only ``run.*`` are the section's `RunSection.check`; the
ones that tie it to the strategy or the data partitions are in `fl_geo.config`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from fl_geo.errors import require
from fl_geo.ray_cluster import check_ray_section  # run.ray_address, client_cpus, client_gpus

RUN_LOGGERS = ("wandb", "mlflow")


@dataclass
class RunSection:
    """What to run and where to write it."""

    name: str = "run"
    seed: int = 0
    rounds: int = 10
    num_clients: int = 4  # simulated datacenters (Flower virtual SuperNodes)
    max_tokens: int = 0  # stop once this many tokens were consumed (0 = only run.rounds limits)
    # wall: replies in arrival order; virtual: modelled finish times from run.scenario decide the
    # order and every metric carries time/virtual_s (deterministic for a seed).
    clock: str = "wall"
    scenario: str = "lan_uniform"  # a name under configs/scenarios/ or a YAML path
    # ray: Flower's simulation runtime (one Ray actor per sim_cpus, ClientApps in parallel);
    # inline: ClientApps run in this process one after another (no Ray start-up; deterministic).
    backend: str = "ray"
    out_dir: str = "runs"
    eval_every: int = 1  # server-side validation every k outer steps (0 = only at the end)
    eval_batches: int = 16
    client_eval_every: int = 0  # ask clients for validation on their partition every k steps (0 = never)
    threads_per_client: int = 1  # torch threads per client process (docs/data.md: never oversubscribe)
    # The server's folds and outer steps are many small memory-bound ops: one thread avoids waiting
    # on descheduled workers while clients share the cores (10-60x slower at 2 under load).
    server_threads: int = 1
    sim_cpus: int = 2  # Ray CPUs; one actor per CPU since each client asks for one
    # backend=ray: "" = Flower starts (and stops) its own local Ray with sim_cpus CPUs; "auto" = the
    # cluster this machine joined with `ray start`; HOST:PORT = a running cluster's head (GCS)
    # address (docs/deploy.md, "A Ray cluster"). With a cluster, its CPUs replace sim_cpus.
    ray_address: str = ""
    client_cpus: float = 1.0  # Ray CPUs each ClientApp actor reserves (actors = CPUs / client_cpus)
    client_gpus: float = 0.0  # Ray GPUs each actor reserves (0.25 = four actors share one GPU)
    min_nodes: int = 0  # nodes to wait for before round 1 (0 = num_clients)
    wait_nodes_timeout_s: float = 120.0
    progress: bool = True
    tensorboard: bool = True
    # Experiment trackers besides metrics.jsonl (always) and TensorBoard: wandb, mlflow (optional
    # packages; settings from their environment variables, fl_geo/runtime/loggers.py).
    loggers: list[str] = field(default_factory=list)
    # Server checkpoints (fl_geo/core/checkpoint.py): every k outer steps (0 = off), newest `keep` kept,
    # in checkpoint_dir ("" = <run dir>/checkpoints). resume=true continues from the newest valid
    # checkpoint there (a corrupt one is skipped) and starts fresh when there is none and nothing
    # to replace (fl_geo.server_app.open_checkpoints lists what it refuses instead).
    checkpoint_every: int = 0
    checkpoint_keep: int = 3
    checkpoint_dir: str = ""
    resume: bool = False
    # Where simulated clients keep their inner state on disk so a resumed run finds it ("" = off;
    # `fl-geo run` fills in <run dir>/client_state when checkpoints are on). Deployed SuperNodes
    # use their own node config `state-dir` instead.
    client_state_dir: str = ""
    # Live nodes below which the server pauses instead of stepping on too little (0 = off).
    min_live_nodes: int = 0
    min_live_wait_s: float = 600.0  # how long to wait for enough live nodes before giving up
    # With clock=wall: replay run.scenario's failure trace as real faults (a failing node's ClientApp
    # answers its job with an error; the node gets nothing until its repair), jobs laid on each
    # node's modelled time line in dispatch order; wall seconds per modelled second (fl_geo/runtime/wall_faults.py).
    wall_faults: bool = False
    wall_fault_scale: float = 0.0

    def check(self) -> None:
        """Raise `ConfigError` for a ``run.*`` value out of its range or unknown."""
        self._check_name()
        self._check_processes()
        self._check_cadence()
        self._check_clock()

    def _check_name(self) -> None:
        """``run.name`` names a directory *inside* ``run.out_dir`` / ``--out``: one path component.
        A separator, ``..`` or an absolute name would put the run's files (and its pruning) outside."""
        name = self.name
        seps = [s for s in ("/", "\\", os.sep, os.altsep or "") if s and s in name]
        require(bool(name) and name not in (".", "..") and not seps and "\0" not in name,
                f"run.name must be one directory name (no '/', '\\', not '.' or '..'), got {name!r}; "
                "use run.out_dir or --out to choose where runs go")

    def _check_processes(self) -> None:
        require(self.rounds >= 1, f"run.rounds must be >= 1, got {self.rounds}")
        require(self.num_clients >= 1, f"run.num_clients must be >= 1, got {self.num_clients}")
        require(self.backend in ("ray", "inline"), f"run.backend must be ray or inline, got '{self.backend}'")
        require(self.threads_per_client >= 1, "run.threads_per_client must be >= 1")
        require(self.server_threads >= 1, "run.server_threads must be >= 1")
        require(self.sim_cpus >= 1, "run.sim_cpus must be >= 1")
        check_ray_section(self)

    def _check_cadence(self) -> None:
        """Evaluation, checkpoints and the waits for nodes."""
        require(self.eval_every >= 0 and self.client_eval_every >= 0, "run.eval_every / client_eval_every must be >= 0")
        require(self.eval_batches >= 1, "run.eval_batches must be >= 1")
        require(self.checkpoint_every >= 0, f"run.checkpoint_every must be >= 0, got {self.checkpoint_every}")
        require(self.checkpoint_keep >= 1, f"run.checkpoint_keep must be >= 1, got {self.checkpoint_keep}")
        require(self.min_live_nodes >= 0, f"run.min_live_nodes must be >= 0, got {self.min_live_nodes}")
        require(self.min_live_wait_s >= 0, f"run.min_live_wait_s must be >= 0, got {self.min_live_wait_s}")
        require(self.wait_nodes_timeout_s >= 0, f"run.wait_nodes_timeout_s must be >= 0, got {self.wait_nodes_timeout_s}")
        require(self.min_nodes >= 0, f"run.min_nodes must be >= 0, got {self.min_nodes}")

    def _check_clock(self) -> None:
        """The clock, the replayed faults, the token budget and the trackers."""
        require(self.clock in ("wall", "virtual"), f"run.clock must be wall or virtual, got '{self.clock}'")
        require(not self.wall_faults or self.clock == "wall",
                "run.wall_faults=true needs run.clock=wall (a virtual clock replays the failure trace itself)")
        require(self.wall_fault_scale >= 0, f"run.wall_fault_scale must be >= 0 wall seconds per modelled second, "
                                            f"got {self.wall_fault_scale}")
        require(self.max_tokens >= 0, "run.max_tokens must be >= 0")
        unknown = [name for name in self.loggers if name not in RUN_LOGGERS]
        require(not unknown, f"run.loggers {unknown} unknown; valid: wandb, mlflow (metrics.jsonl is always "
                             "written; TensorBoard is run.tensorboard)")
