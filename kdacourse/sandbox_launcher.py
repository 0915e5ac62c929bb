"""The start of a sandboxed process where no namespace can be made (kdacourse.sandbox, isolation
"own user"): run by the grader, as root, with `python -I -S sandbox_launcher.py SPEC`, it becomes the
sandbox's user and then the child, in this order:

1. the resource limits (set while root, so that the user cannot raise them again);
2. no supplementary groups, then the user's own gid and uid (real, effective and saved), checked;
3. killed when its parent dies (PR_SET_PDEATHSIG, set after the change of user, which clears it),
   and gone at once if that parent has already died;
4. the network filter (kdacourse/seccomp.py, loaded by path: this file imports only the standard
   library): a socket of any family but AF_UNIX fails with EACCES; where the kernel refuses the
   filter the process goes on without it, as the self-test, which started the same way, reported;
5. its private folder as the working directory, and execve of the child with the environment given.

SPEC is JSON: {"rlimits": {RLIMIT_*: value}, "uid", "gid", "parent": pid, "filter": hex or null,
"cwd", "environment": {...}, "argv": [...]}.
"""

import ctypes
import importlib.util
import json
import os
import resource
import signal
import sys
from pathlib import Path

PR_SET_PDEATHSIG = 1


def _seccomp():
    spec = importlib.util.spec_from_file_location("course_seccomp", Path(__file__).with_name("seccomp.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(spec):
    seccomp = _seccomp()  # read while root: the user may not be able to read the course's files
    for name, value in spec["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    uid, gid = int(spec["uid"]), int(spec["gid"])
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid) or os.getgroups():
        sys.exit("sandbox launcher: could not become the sandbox's user")
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        sys.exit("sandbox launcher: prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != int(spec["parent"]):
        os._exit(70)
    if spec["filter"]:
        try:
            seccomp.install(bytes.fromhex(spec["filter"]))
        except OSError:
            pass  # no filter here: the self-test said whether the network is cut
    os.chdir(spec["cwd"])
    os.execve(spec["argv"][0], spec["argv"], spec["environment"])


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
