"""The sharded parameter server for Di-PS: the follower's shard state, its gRPC data path (frames,
channel, service, client), the follower process and the supervisor that restarts it from its
checkpoint. The leader that drives it is ``fl_geo.strategies.sharded``.
"""
