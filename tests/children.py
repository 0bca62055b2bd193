"""Processes the tests start end with the test process, even when that one is killed."""
import sys

# NOTE: prctl(PR_SET_PDEATHSIG) survives execve: set in a launcher that then execs the command,
# it needs no preexec_fn (unsafe beside threads) in the test process
_LAUNCHER = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "
             "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")


def ending_with_parent(args: list[str]) -> list[str]:
    """`python args...` run so that the kernel sends it SIGTERM once its parent exits.

    A pytest-xdist worker killed for memory would otherwise leave its `muser serve` children
    running, holding a model each, and leave less memory still to the tests after it.
    """
    return [sys.executable, "-c", _LAUNCHER, *args]
