"""A hostile local user against an elastic job's store: deletes keys, replays records.

Like ``tests/security/attacker.py`` (whose privilege drop it reuses), it runs
as uid ``nobody`` when started as root and knows only the store's address: it
cannot sign anything, so all it can do is delete keys and write back values it
read earlier under the same key.

Usage: ``python -m tests.security.elastic_attacker SPEC.json`` -> JSON report on stdout.

Spec fields: ``host``, ``port``, ``seconds`` (how long to keep attacking),

* ``delete``: substrings; every key containing one is deleted as soon as it
  appears (again and again, until ``seconds`` are over);
* ``replay``: ``{"suffix": ..., "after": ..., "repeat": bool}``: records the
  first value of the key ending in ``suffix``; once that value changes (and,
  with ``after``, once a key ending in ``after`` exists), writes the recorded
  value back -- once, or with ``repeat`` every time the key holds something else.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import sys
import time

import torch.distributed as dist

from tests.security.attacker import drop_privileges


def main() -> int:
    spec = json.load(open(sys.argv[1]))
    drop_privileges()
    report = {"uid": os.getuid(), "deleted": [], "replayed": 0, "recorded": None,
              "replaced": None, "errors": []}
    store = dist.TCPStore(spec["host"], spec["port"], 1, False,
                          timeout=datetime.timedelta(seconds=10))
    end = time.monotonic() + spec.get("seconds", 5.0)
    replay = spec.get("replay")
    target = recorded = None
    ready = False  # once true, stays so
    while time.monotonic() < end:
        try:
            keys = store.list_keys()
            for key in keys:
                if any(part in key for part in spec.get("delete", [])):
                    if store.delete_key(key) and key not in report["deleted"]:
                        report["deleted"].append(key)
            if replay is not None and target is None:
                target = next((k for k in keys if k.endswith(replay["suffix"])), None)
                if target is not None:
                    recorded = store.get(target)
                    report["recorded"] = base64.b64encode(recorded).decode()
            ready = ready or replay is not None and (
                not replay.get("after") or any(k.endswith(replay["after"]) for k in keys))
            # The record under attack is polled on its own between listings: the old
            # value goes back within a round trip of the new one's arrival.
            for _ in range(20 if ready and replay is not None and target is not None else 0):
                current = store.get(target)
                if current != recorded:
                    store.set(target, recorded)
                    report["replayed"] += 1
                    if report["replaced"] is None:
                        report["replaced"] = base64.b64encode(current).decode()
                    if not replay.get("repeat"):
                        replay = None
                        break
                time.sleep(0.0005)
        except Exception as exc:  # the job ended and took its store with it
            report["errors"].append(f"{type(exc).__name__}: {exc}")
            break
        time.sleep(0.001)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
