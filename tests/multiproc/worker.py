"""Entry point of one test rank: load the pickled function, run it, store the result."""

import sys
import traceback

import cloudpickle
import torch


def main() -> int:
    torch.set_num_threads(1)
    payload, result_path = sys.argv[1], sys.argv[2]
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
