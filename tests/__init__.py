"""The test suite (``make test`` runs it on two pytest-xdist workers; see the README's Tests).

Before torch is imported: OpenMP threads that finish their share of an op sleep instead of
spinning. ``make test`` runs two workers on a 2-core machine, each torch with two threads (the
thread count some bit-exact tests and the bit-identity records pin), and spinning threads would
take the cores the other worker's threads are waiting for.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
