"""Which host addresses never leave this machine: the one place plaintext is acceptable.

A leaf module (standard library only) so that every layer applies the same rule: the deployment
topology (``--insecure`` SuperLinks), the parameter-server settings (``ps.host``) and the follower
process's own bind address.
"""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


def is_loopback(host: str) -> bool:
    """True for addresses that never leave this machine.

    A host name other than ``localhost`` counts as remote: we cannot know where DNS points it.
    """
    h = host.strip().strip("[]").lower()
    if h in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False
