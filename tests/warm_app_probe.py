"""A stand-in app command for tests/test_warm_apps.py: reports what a started app process sees.

``main()`` prints one JSON line to stdout (its arguments, working directory, ``PROBE_X``, its pid
and parent pid, whether ``fractions`` was already imported: the tests' app server preloads it),
one line to stderr, then acts on its first argument: ``exitN`` exits with N, ``sleep`` waits
(SIGTERM makes it exit 7), ``signal`` kills itself with SIGUSR1.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else "exit0"
    if mode == "sleep":  # before the report: a test signals as soon as it reads it
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "x": os.environ.get("PROBE_X"), "pid": os.getpid(),
                      "ppid": os.getppid(), "preloaded": "fractions" in sys.modules}), flush=True)
    print("probe stderr", file=sys.stderr, flush=True)
    if mode == "sleep":
        time.sleep(120)
    if mode == "signal":
        os.kill(os.getpid(), signal.SIGUSR1)
    return int(mode[4:]) if mode.startswith("exit") else 0


if __name__ == "__main__":
    sys.exit(main())
