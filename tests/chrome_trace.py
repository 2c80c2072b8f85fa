"""What a Chrome-trace consumer (Perfetto, chrome://tracing) needs of a JSON trace file."""

import json

PHASES = {"X", "i", "M"}  # the event types the timeline writes


def load(path):
    """The events of a trace file in the JSON Array Format, checked."""
    with open(path, encoding="utf-8") as f:
        events = json.load(f)  # complete JSON: the array is closed
    check(events)
    return events


def check(events):
    assert isinstance(events, list) and events
    for event in events:
        for key, kind in (("name", str), ("ph", str), ("pid", int), ("tid", int),
                          ("ts", (int, float))):
            assert isinstance(event.get(key), kind), (key, event)
        assert event["ph"] in PHASES, event
        if event["ph"] == "X":
            assert isinstance(event["dur"], (int, float)) and event["dur"] >= 0, event
        if event["ph"] == "i":
            assert event["s"] in ("g", "p", "t"), event
        if event["ph"] == "M":
            assert event["name"] in ("process_name", "process_sort_index"), event
            assert isinstance(event["args"], dict), event
        if "args" in event:
            assert isinstance(event["args"], dict), event


def rows(events):
    """``{row name: pid}`` from the process_name metadata; one pid per row."""
    named = {}
    for e in events:
        if e["ph"] == "M" and e["name"] == "process_name":
            assert e["args"]["name"] not in named, e
            named[e["args"]["name"]] = e["pid"]
    assert len(set(named.values())) == len(named)
    return named


def on_row(events, row, ph="X"):
    """The events of phase ``ph`` on the row named ``row``, in file order."""
    pid = rows(events)[row]
    return [e for e in events if e["pid"] == pid and e["ph"] == ph]
