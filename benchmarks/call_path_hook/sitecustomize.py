"""benchmarks/call_path.py's recorder, loaded by every Python process of a server it starts (PYTHONPATH).

With EMBEDSERV_CALL_PATH_DIR set, a profile function is installed in every thread from interpreter start;
it records nothing until SIGUSR1 (which it acknowledges by writing DIR/<pid>.on) and, from then to SIGUSR2,
notes each function of the project's files (EMBEDSERV_CALL_PATH_ROOT) that is called. SIGUSR2 writes them to
DIR/<pid>.json. Without the variable this file does nothing.
"""

import json
import os
import signal
import sys
import threading

_DIR = os.environ.get("EMBEDSERV_CALL_PATH_DIR")
_ROOT = os.environ.get("EMBEDSERV_CALL_PATH_ROOT", "")
_seen: set = set()
_on = False


def _profile(frame, event, arg):
    if _on and event == "call":
        code = frame.f_code
        if code.co_filename.startswith(_ROOT):
            _seen.add((code.co_filename, code.co_firstlineno, code.co_qualname))


def _start(signum, frame):
    global _on
    _seen.clear()
    _on = True
    open(os.path.join(_DIR, f"{os.getpid()}.on"), "w").close()


def _stop(signum, frame):
    global _on
    _on = False
    rows = sorted(_seen)
    path = os.path.join(_DIR, f"{os.getpid()}.json")
    with open(path + ".tmp", "w") as out:
        with open("/proc/self/comm") as comm:  # a forked front end's argv is its zygote's; its name is its own
            name = comm.read().strip()
        json.dump({"pid": os.getpid(), "argv": sys.argv, "name": name, "functions": rows}, out)
    os.replace(path + ".tmp", path)


if _DIR and _ROOT:
    sys.setprofile(_profile)
    threading.setprofile(_profile)
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
