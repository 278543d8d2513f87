"""The sharded parameter server for Di-PS: followers that each hold a shard, and their data path.

Di-PS (§4.1, "Dual-workflow Mechanism") keeps the model's bytes off the control path: the Flower
ServerApp (the *leader*, `fl_geo.strategies.sharded`) sends and receives only small control
messages, while datacenter clients push update shards to, and pull parameter shards from, the
followers directly over gRPC.

- `follower`: one follower's shard state and arithmetic (framework-free);
- `frames`, `channel`: how tensors travel (header + raw frames) and the gRPC channel settings;
- `service`: the follower's gRPC service (push, pull, control); `client`: the retrying client;
- `auth`: the shared key, per-job tokens (clients) and the leader's request MAC (control);
- `server`, `follower_main`: a follower process; `heartbeat`: the leader's heartbeat service;
- `supervisor`: starts, watches and restarts follower processes from their checkpoints (§4.3).
- `backend`: what the leader calls, whichever the transport: followers in its process
  (``ps.transport=local``) or as supervised processes (``grpc``); `leader_view`: the leader's view
  of a follower process; `access`: the follower service's credential checks.

Import rule (tested by ``tests/test_layers.py``): ``fl_geo.core``, this package, gRPC, torch and
numpy; no Flower.
"""
