"""Entry point of one test rank: load the pickled function, run it, store the result."""

import faulthandler
import os
import signal
import sys
import traceback

import cloudpickle
import torch


def main() -> int:
    torch.set_num_threads(1)
    # The harness sends this before killing a rank that overran its deadline:
    # every thread's stack then lands in the rank's log, showing where it hung.
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    payload, result_path = sys.argv[1], sys.argv[2]
    # Under mpirun every rank gets the same arguments: the path names its rank.
    rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", ""))
    result_path = result_path.replace("{rank}", rank)
    with open(payload, "rb") as f:
        fn, args = cloudpickle.load(f)
    try:
        result = fn(*args)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        return 1
    with open(result_path, "wb") as f:
        cloudpickle.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
