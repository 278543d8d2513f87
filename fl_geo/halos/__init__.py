"""HALoS as a two-tier Flower deployment: the regional and global ServerApps, the bridge by which a
local parameter server is a Flower client of the global one, and the IPC between them. The server
objects themselves are ``fl_geo.core.halos`` (shared with the simulation).
"""
