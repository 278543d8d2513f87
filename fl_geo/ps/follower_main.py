"""Process entry of one follower parameter server (`python -m fl_geo.ps.follower_main`).

Started by `fl_geo.ps.supervisor.FollowerSupervisor`, once per shard and again after a crash. It
rebuilds its `FollowerShard` from the plan and the newest verified checkpoint in its directory
(one must exist: the supervisor writes version 0 before the first launch), so a restart resumes
from the last step the leader saw acknowledged. It then serves the data path, heartbeats to the
leader, writes ``host:port`` to ``--addr-file`` (tmp + rename, so a reader never sees half an
address), and exits cleanly on SIGTERM/SIGINT or when the process that started it is gone.

The supervisor starts it one of two ways: forked from this host's fork server (`fl_geo.fork_server`,
which imported torch once: `run_forked` is the entry, a follower is up in a fraction of a second)
or as a fresh interpreter running this module (``FL_GEO_RANK_START=spawn``, or another Python).

The data path's shared key (`fl_geo.ps.auth`) comes from ``--key-file`` (hex, a file private to
its owner: ``(umask 077; openssl rand -hex 32 > ps.key)``) or else the environment variable
``FLGEO_PS_KEY`` (hex; what the supervisor uses), never from the command line, where ``ps``
would show it. A follower without a key refuses to start: every push, pull and control request
it serves must be authenticated. The key is read at every start, so a restarted follower
verifies the tokens the leader issued before the restart.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from fl_geo.core.checkpoint import CheckpointStore
from fl_geo.core.compress import Compressor
from fl_geo.core.compress import settings_from_json as uplink_from_json
from fl_geo.core.outer import build_outer_optimizer
from fl_geo.core.shards import ShardPlan
from fl_geo.errors import ConfigError
from fl_geo.fork_server import pid_exists
from fl_geo.hosts import is_loopback
from fl_geo.ps.auth import KEY_ENV, DataPathAuth, key_from_env, read_key_file
from fl_geo.ps.channel import TlsFiles
from fl_geo.ps.follower import SEND_MODES, WIRE_DTYPES, FollowerShard
from fl_geo.ps.frames import INCARNATION
from fl_geo.ps.server import FollowerServer

log = logging.getLogger("fl_geo")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fl_geo.ps.follower_main", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", required=True, help="ShardPlan JSON file")
    p.add_argument("--index", type=int, required=True, help="shard index this follower holds")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to serve on; without --tls-ca only a loopback one (see --allow-plaintext-host)")
    p.add_argument("--allow-plaintext-host", default=None, metavar="HOST",
                   help="serve plaintext on this non-loopback --host (it must name the same host): "
                        "for a trusted network only (ps.allow_insecure_remote)")
    p.add_argument("--port", type=int, default=0, help="0: any free port (reported in --addr-file)")
    p.add_argument("--checkpoint-dir", required=True, help="this follower's CheckpointStore directory")
    p.add_argument("--keep", type=int, default=3, help="checkpoints kept")
    p.add_argument("--leader", default=None, help="host:port of the leader's heartbeat service")
    p.add_argument("--optimizer", default="nesterov", help="outer optimizer name (fl_geo.core.outer)")
    p.add_argument("--optimizer-kwargs", default="{}", help="JSON object of optimizer arguments")
    p.add_argument("--wire", default="bf16", choices=sorted(WIRE_DTYPES))
    p.add_argument("--send", default="pseudo_grad", choices=SEND_MODES)
    p.add_argument("--compress", default=None,
                   help="JSON of the uplink's CompressSettings (wire.compress): pushes are this shard's payloads")
    p.add_argument("--compress-down", default=None,
                   help="JSON of the downlink's CompressSettings (wire.compress_down): keep this shard of the "
                        "public model and send sites its deltas")
    p.add_argument("--wire-down", default="fp32", choices=sorted(WIRE_DTYPES),
                   help="the downlink's precision (wire.down): the public model's grid")
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--addr-file", default=None, help="where to write host:port once serving")
    p.add_argument("--max-workers", type=int, default=16, help="gRPC handler threads")
    p.add_argument("--max-pending", type=int, default=64, help="unhandled pushes held before refusing more")
    p.add_argument("--parent-pid", type=int, default=None,
                   help="exit when this process (the supervisor's) has ended")
    p.add_argument("--tls-ca", default=None, help="CA certificate (PEM): serve TLS and send heartbeats over it")
    p.add_argument("--tls-cert", default=None, help="this follower's certificate (PEM)")
    p.add_argument("--tls-key", default=None, help="its private key (PEM)")
    p.add_argument("--key-file", default=None,
                   help=f"the leader/follower shared key (hex, mode 0600); default: ${KEY_ENV}")
    p.add_argument("--torch-threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    return p


def load_follower(args: argparse.Namespace) -> tuple[FollowerShard, CheckpointStore]:
    """The shard as of its newest verified checkpoint (θ, optimizer state, version)."""
    plan = ShardPlan.from_json(Path(args.plan).read_text())
    if not 0 <= args.index < plan.num_shards:
        raise SystemExit(f"shard index {args.index} outside the plan of {plan.num_shards}")
    kwargs = json.loads(args.optimizer_kwargs)
    if not isinstance(kwargs, dict):
        raise SystemExit("--optimizer-kwargs must be a JSON object")
    store = CheckpointStore(args.checkpoint_dir, keep=args.keep)
    ckpt = store.load_latest()
    if ckpt is None:
        raise SystemExit(f"no verified checkpoint in {args.checkpoint_dir}: the supervisor writes "
                         "version 0 before the first launch")
    numel = plan.shards[args.index].numel
    optimizer = build_outer_optimizer(args.optimizer, numel, **kwargs)
    params = ckpt.state.get("params")
    # Adopt the loaded tensor as θ_s instead of allocating a second shard-sized buffer;
    # load_state_dict validates it (and everything else) and copies it onto itself.
    if not (torch.is_tensor(params) and params.dtype == torch.float32 and params.dim() == 1
            and params.numel() == numel and params.is_contiguous()):
        params = None
    try:
        settings = uplink_from_json(args.compress, "--compress")
        down = uplink_from_json(args.compress_down, "--compress-down")
        down_compressor = Compressor(down) if down is not None else None
    except (ConfigError, ValueError) as exc:
        raise SystemExit(f"--compress / --compress-down: {exc}") from None
    follower = FollowerShard(plan, args.index, optimizer, params=params, wire=args.wire, send=args.send,
                             max_pending=args.max_pending,
                             compressor=Compressor(settings) if settings is not None else None,
                             down_compressor=down_compressor, wire_down=args.wire_down)
    follower.load_state_dict(ckpt.state)
    log.info("follower %d: loaded checkpoint %s (version %d, %d elements)", args.index, ckpt.path,
             follower.version, numel)
    return follower, store


def load_auth(args: argparse.Namespace) -> DataPathAuth:
    """The data path's authenticator from ``--key-file`` or `KEY_ENV`; SystemExit without a key."""
    try:
        key = read_key_file(args.key_file) if args.key_file else key_from_env()
    except (OSError, ValueError) as exc:
        raise SystemExit(f"follower {args.index}: {exc}") from None
    if key is None:
        raise SystemExit(f"follower {args.index}: no data path key: give --key-file or set ${KEY_ENV} "
                         "(the leader's supervisor does this)")
    return DataPathAuth(key)


def check_bind(args: argparse.Namespace) -> None:
    """SystemExit unless the bind is safe: TLS, a loopback host, or plaintext on a host the
    operator named twice (``--host H --allow-plaintext-host H``), never by a default or a typo."""
    if args.tls_ca or is_loopback(args.host):
        return
    if args.allow_plaintext_host is not None and args.allow_plaintext_host == args.host:
        log.warning("follower %d: serving plaintext on %s (--allow-plaintext-host)", args.index, args.host)
        return
    raise SystemExit(f"follower {args.index}: --host {args.host} is not a loopback address: give --tls-ca/"
                     f"--tls-cert/--tls-key, or --allow-plaintext-host {args.host} for a trusted network")


def _watch(pid: int | None) -> Callable[[], bool]:
    """A test of whether process ``pid`` still runs (always true for None).

    A follower forked from the fork server is not the supervisor's child, and the fork server
    outlives a killed supervisor while any process it forked holds its pipe, so the parent
    process id says nothing; a pidfd does (Linux 5.3+): it becomes readable when ``pid`` ends, and
    unlike ``kill(pid, 0)`` it cannot mistake a newer process that reused the number for it. Where
    there is none, a started child compares its parent id, a forked one probes the number."""
    if pid is None:
        return lambda: True
    if hasattr(os, "pidfd_open"):
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return lambda: False  # ended before we looked
        except OSError:
            fd = None
        if fd is not None:
            return lambda: not select.select([fd], [], [], 0)[0]
    if os.getppid() == pid:
        return lambda: os.getppid() == pid
    return lambda: pid_exists(pid)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s follower-{args.index}[{os.getpid()}]: %(message)s")
    if args.torch_threads > 0:
        torch.set_num_threads(args.torch_threads)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())

    check_bind(args)
    auth = load_auth(args)
    follower, store = load_follower(args)
    server = FollowerServer(follower, store, host=args.host, port=args.port, leader=args.leader,
                            heartbeat_s=args.heartbeat_s, max_workers=args.max_workers, auth=auth,
                            tls=TlsFiles(Path(args.tls_ca), Path(args.tls_cert), Path(args.tls_key)) if args.tls_ca else None)
    try:
        server.start()
    except OSError as exc:
        log.error("follower %d: %s", args.index, exc)
        return 3
    if args.addr_file:
        addr = Path(args.addr_file)
        tmp = addr.with_name(addr.name + f".{os.getpid()}.tmp")
        tmp.write_text(server.address + "\n")
        os.replace(tmp, addr)
    log.info("follower %d serving at %s (incarnation %s, leader %s)", args.index, server.address,
             INCARNATION, args.leader)
    parent_alive = _watch(args.parent_pid)
    try:
        while not stop.wait(1.0):
            if not parent_alive():
                log.warning("follower %d: parent %d is gone; shutting down", args.index, args.parent_pid)
                break
    finally:
        server.stop(grace=1.0)
        log.info("follower %d stopped", args.index)
    return 0


def run_forked(argv: list[str], log_path: str, env: dict[str, str]) -> None:
    """The entry of a follower forked from the fork server: the same process a fresh
    interpreter running `main` would be.

    It leads a session of its own (the supervisor signals the follower's process group), writes
    stdout and stderr to ``log_path`` (appended), reads nothing from stdin, takes ``env`` into its
    environment (the data path's key travels here, pickled over the fork server's pipe, never on
    a command line), and, as any follower, exits when the supervisor's process named by
    ``--parent-pid`` has ended (not its parent, the fork server). The exit status is `main`'s."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    os.environ.update(env)
    sys.exit(main(argv))


if __name__ == "__main__":
    sys.exit(main())
