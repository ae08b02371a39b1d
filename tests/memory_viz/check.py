"""Checks a trainkit memory_viz.pickle against PyTorch's own memory-viewer code.

Not run by `cargo test` (it needs PyTorch). Usage:

    trainkit train --steps 3 --timeline /tmp/tl
    python tests/memory_viz/check.py /tmp/tl/memory_viz.pickle [/tmp/tl/memory_viz.html]

It loads the snapshot with `pickle`, runs `torch.cuda._memory_viz.segsum` (which checks
that the blocks of every segment add up to its size) and `trace` (which replays the
allocations and frees), writes the HTML page of `trace_plot` (open it in a browser: it
loads the same viewer as https://pytorch.org/memory_viz), and replays the trace the way
the viewer's JavaScript does: a `free_requested` directly followed by its
`free_completed`, every address inside a segment, no address given twice while live.
"""

import pickle
import sys

from torch.cuda import _memory_viz as mv


def main(path, html=None):
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    assert set(snapshot) >= {"segments", "device_traces"}, sorted(snapshot)

    print(mv.segsum(snapshot))
    trace = mv.trace(snapshot)
    lines = trace.splitlines()
    print("\n".join(lines[:12]))
    print("...")
    print("\n".join(lines[-3:]))

    segments = [
        (s["address"], s["address"] + s["total_size"]) for s in snapshot["segments"]
    ]
    for device, entries in enumerate(snapshot["device_traces"]):
        live = {}
        previous = None
        for e in entries:
            addr, size = e["addr"], e["size"]
            assert any(a <= addr < b or (a == addr == b) for a, b in segments), e
            if e["action"] == "alloc":
                assert addr not in live, f"address {addr:#x} given twice"
                live[addr] = size
            elif e["action"] == "free_requested":
                assert live.get(addr) == size, e
            elif e["action"] == "free_completed":
                assert previous is not None
                assert previous["action"] == "free_requested", previous
                assert previous["addr"] == addr, (previous, e)
                del live[addr]
            else:
                raise AssertionError(f"unexpected action {e['action']}")
            previous = e
        at_end = sum(
            b["size"]
            for s in snapshot["segments"]
            if s["device"] == device
            for b in s["blocks"]
            if b["state"] == "active_allocated"
        )
        assert at_end == sum(live.values()), (at_end, sum(live.values()))
        print(
            f"device {device}: {len(entries)} trace entries, {len(live)} buffers "
            f"({mv._format_size(at_end)}) live at the end"
        )

    page = mv.trace_plot(snapshot)
    if html:
        with open(html, "w") as f:
            f.write(page)
        print(f"wrote {html}")
    print("ok")


if __name__ == "__main__":
    main(*sys.argv[1:3])
