"""``fl-geo deploy ...``: the command line of fl_geo.deploy (certificates, a topology's SuperLink
and SuperNodes, runs, status, shutdown; and HALoS's two tiers). `fl_geo.cli` adds it to the
``fl-geo`` parser with `add_parser`; the work is in `certificates`, `lifecycle`, `launch` and
`halos`. Deployment errors are one line on stderr, naming the log to read.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from fl_geo.errors import ConfigError

__all__ = ["add_parser", "cmd_deploy"]


def _one_config(items: list[str], command: str) -> tuple[str, list[str]]:
    """Exactly one config file plus ``key=value`` overrides (``fl-geo deploy run`` and friends)."""
    configs = [a for a in items if "=" not in a]
    overrides = [a for a in items if "=" in a]
    if len(configs) != 1:
        raise ConfigError(f"fl-geo {command} takes one config file (plus key=value overrides)")
    return configs[0], overrides


def cmd_deploy(args: argparse.Namespace) -> int:
    """``fl-geo deploy ...``: deployment errors are reported here, as one line naming the log."""
    from fl_geo.deploy import topology

    try:
        return _deploy(args)
    except topology.DeployError as exc:
        print(f"fl-geo deploy: {exc}", file=sys.stderr)
        return 1


def _deploy(args: argparse.Namespace) -> int:
    import json

    from fl_geo.deploy import certificates, launch, lifecycle, topology

    if args.deploy_cmd == "certs":
        nodes = [n for n in args.nodes.split(",") if n]
        hosts = [h for h in args.hosts.split(",") if h]
        if args.topology:
            topo = topology.load_topology(args.topology)
            nodes = [n.name for n in topo.nodes]
            hosts = list(dict.fromkeys([*topo.cert_hosts(), *hosts]))
        paths = certificates.generate_certs(args.out, hosts, nodes, days=args.days)
        print(f"CA               {paths.ca_cert}\n"
              f"SuperLink cert   {paths.server_cert} (+ {paths.server_key.name}) for {', '.join(hosts)}\n"
              f"SuperNode keys   {paths.root / 'supernodes'}/<node>.key|.pub for {', '.join(nodes)}\n"
              f"public key list  {paths.public_keys}")
        return 0
    if args.deploy_cmd.startswith("halos-"):
        return _deploy_halos(args)
    topo = topology.load_topology(args.topology)
    if args.deploy_cmd == "up":
        res = lifecycle.up(topo, timeout_s=args.timeout, echo=True)
        print(f"{topo.name} up at {topo.address} ({'TLS' if topo.security.tls else 'insecure'}"
              f"{' + SuperNode auth' if topo.security.auth else ''}): SuperLink healthy {res.healthy_s:.1f} s, "
              f"{len(topo.nodes)} SuperNodes online {res.nodes_online_s:.1f} s; logs in {topo.logs_dir}")
        return 0
    if args.deploy_cmd == "run":
        config, overrides = _one_config(args.items, "deploy run")
        res = launch.run_experiment(topo, config, overrides, out_dir=args.out, stream=args.stream,
                                    wait=not args.no_wait, timeout_s=args.timeout)
        if args.no_wait:
            print(res.run_id)
            return 0
        if res.summary is not None:
            print(json.dumps(res.summary, indent=2))
        return 0 if res.ok else 1
    if args.deploy_cmd == "status":
        st = lifecycle.status(topo)
        if args.json:
            print(json.dumps(st, indent=2))
        else:
            print(f"{topo.name} at {st['address']}: SuperLink {'healthy' if st['healthy'] else 'not answering'}")
            for p in st["processes"]:
                print(f"  {p['role']:9s} {p['name']:12s} pid {p['pid']:<7d} {'alive' if p['alive'] else 'dead '}  {p['log']}")
            for n in st["nodes"]:
                print(f"  node {n.get('node-id')}: {n.get('status')}")
            if not st["processes"]:
                print(f"  nothing recorded in {topo.pids_path}")
        return 0 if st["processes"] and all(p["alive"] for p in st["processes"]) else 3
    if args.deploy_cmd == "down":
        res = lifecycle.down(topo, grace_s=args.grace)
        if not res.signalled:
            print(f"{topo.name}: nothing running (no live process in {topo.pids_path})")
        else:
            print(f"{topo.name}: stopped {len(res.signalled)} processes"
                  f"{f', {len(res.killed)} needed SIGKILL' if res.killed else ''}")
        if res.survivors:
            print(f"still alive: {res.survivors}", file=sys.stderr)
            return 1
        return 0
    raise AssertionError(args.deploy_cmd)


def _deploy_halos(args: argparse.Namespace) -> int:
    """``fl-geo deploy halos-*``: the two-tier HALoS layout (fl_geo/deploy/halos.py)."""
    import json

    from fl_geo.deploy import halos as dh

    topo = dh.load_halos_topology(args.topology)
    if args.deploy_cmd == "halos-up":
        times = dh.halos_up(topo, timeout_s=args.timeout, echo=True)
        tiers = ", ".join(f"{k} {v:.1f} s" for k, v in times.items())
        print(f"{topo.name} up: {len(topo.regions)} regions, {topo.num_workers} workers, "
              f"{len(topo.regions)} bridges; online after: {tiers}; LPS sockets in {topo.ipc_dir}")
        return 0
    if args.deploy_cmd == "halos-run":
        config, overrides = _one_config(args.items, "deploy halos-run")
        res = dh.run_halos(topo, config, overrides, out_dir=args.out, timeout_s=args.timeout,
                           ipc_timeout_s=args.ipc_timeout,
                           resume="global" if args.resume_global else args.resume_region)
        print(json.dumps({"statuses": res.statuses, "wall_s": round(res.wall_s, 1),
                          "run_dirs": {k: str(v) for k, v in res.run_dirs.items()},
                          "summaries": res.summaries}, indent=2))
        return 0 if res.ok else 1
    if args.deploy_cmd == "halos-status":
        st = dh.halos_status(topo)
        print(json.dumps(st, indent=2, default=str))
        return 0 if all(t["processes"] and all(p["alive"] for p in t["processes"]) for t in st.values()) else 3
    if args.deploy_cmd == "halos-down":
        res = dh.halos_down(topo, grace_s=args.grace)
        survivors = [p for r in res.values() for p in r.survivors]
        print(f"{topo.name}: stopped {sum(len(r.signalled) for r in res.values())} processes")
        if survivors:
            print(f"still alive: {survivors}", file=sys.stderr)
            return 1
        return 0
    raise AssertionError(args.deploy_cmd)


def _up_arguments(parser: argparse.ArgumentParser) -> None:
    """``up`` and ``halos-up``: the topology, and how long to wait for it to come up."""
    parser.add_argument("topology")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for health and node registration")


def _run_arguments(parser: argparse.ArgumentParser, *, items: str, switches: dict[str, str] | None = None,
                   out: str, timeout: str) -> None:
    """``run`` and ``halos-run``: the topology, one config file with overrides (``items``: its
    help), the command's own on/off ``switches`` (flag -> help), the runs' out_dir and the time
    limit. Only the help texts differ between the two commands: one SuperLink's run or every
    tier's."""
    parser.add_argument("topology")
    parser.add_argument("items", nargs="+", help=items)
    for flag, text in (switches or {}).items():
        parser.add_argument(flag, action="store_true", help=text)
    parser.add_argument("--out", default=None, help=out)
    parser.add_argument("--timeout", type=float, default=0.0, help=timeout)


def _down_arguments(parser: argparse.ArgumentParser) -> None:
    """``down`` and ``halos-down``: the topology, and the grace before SIGKILL."""
    parser.add_argument("topology")
    parser.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")


def add_parser(sub: Any) -> None:
    """Add ``fl-geo deploy`` and its subcommands to the ``fl-geo`` parser's subparsers."""
    dp = sub.add_parser("deploy", help="deployment across sites: certificates, SuperLink/SuperNodes, runs")
    dsub = dp.add_subparsers(dest="deploy_cmd", required=True)
    c = dsub.add_parser("certs", help="test CA, SuperLink certificate and SuperNode auth keys (openssl)")
    c.add_argument("--out", required=True, help="folder for the certificates and keys")
    c.add_argument("--hosts", default="127.0.0.1,localhost", help="names/IPs the SuperLink certificate covers")
    c.add_argument("--nodes", default="dc0,dc1,dc2", help="SuperNode names, one key pair each")
    c.add_argument("--topology", help="take node names and the SuperLink host from this topology")
    c.add_argument("--days", type=int, default=365, help="validity of the SuperLink certificate")
    _up_arguments(dsub.add_parser("up", help="start the SuperLink and SuperNodes of a topology on this host"))
    _run_arguments(dsub.add_parser("run", help="submit a config with `flwr run` and wait for it"),
                   items="one config file and key=value overrides",
                   switches={"--stream": "stream the run's logs while waiting",
                             "--no-wait": "print the run id and return at once"},
                   out="run.out_dir for the ServerApp (default <project>/runs)",
                   timeout="stop the run after this many seconds (0 = none)")
    s = dsub.add_parser("status", help="recorded processes, SuperLink health and nodes")
    s.add_argument("topology")
    s.add_argument("--json", action="store_true")
    _down_arguments(dsub.add_parser("down", help="stop every recorded process (SIGTERM, then SIGKILL)"))
    _up_arguments(dsub.add_parser("halos-up",
                                  help="HALoS two tiers: global SuperLink + bridges, regional SuperLinks + workers"))
    hr = dsub.add_parser("halos-run", help="submit the regional ServerApps (LPS) and the global ServerApp (GPS), wait")
    _run_arguments(hr, items="one config file (strategy.name=halos) and key=value overrides",
                   out="run.out_dir of every tier (default <project>/runs)",
                   timeout="stop the runs after this many seconds (0 = none)")
    hr.add_argument("--ipc-timeout", type=float, default=600.0,
                    help="seconds an LPS/bridge waits for the other tier before giving up")
    hr.add_argument("--resume-global", action="store_true",
                    help="submit only the global ServerApp, resumed from its newest checkpoint in run.checkpoint_dir "
                         "(the same command and overrides as the interrupted halos-run); the regional runs, still "
                         "going, merge its model and go on. Within --ipc-timeout of the crash, or the regions give up")
    hr.add_argument("--resume-region", metavar="REGION",
                    help="submit only that region's ServerApp, resumed from its newest checkpoint (run.checkpoint_dir/"
                         "REGION); the global server sends it its model again for --ipc-timeout seconds after the "
                         "region's exchange failed")
    hs = dsub.add_parser("halos-status", help="processes, health and nodes of every tier (JSON)")
    hs.add_argument("topology")
    _down_arguments(dsub.add_parser("halos-down", help="stop every tier's recorded processes"))
    dp.set_defaults(func=cmd_deploy)
