"""Runs an example program as ``__main__``, then leaves without interpreter finalization:

    python -m torch.distributed.run --nproc-per-node 2 tests/example_main.py docs/examples/transports.py

With torch 2.13's gloo backend a rank aborts about one run in ten at exit ("terminate called without an active
exception", no Python frame), after the program has finished: a gloo worker thread drops its last references to a
finished collective's tensors after the caller has moved on, and if the interpreter is finalizing by then CPython
ends that thread in the middle of C++ (pytorch/pytorch#190489). ``destroy_process_group`` joins those threads only
if nothing else still holds the group, and a group that ``torch.compile`` traced collectives over stays held. So,
as the spawned gloo workers of tests/comm_workers.py do, this exits with ``os._exit(0)`` once the program has run
to its end. An exception in the program still propagates: it prints its traceback and exits with status 1.
"""

import os
import runpy
import sys

if __name__ == "__main__":
    sys.argv = sys.argv[1:]  # the program sees its own command line
    runpy.run_path(sys.argv[0], run_name="__main__")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
