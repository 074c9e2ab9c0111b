"""A text summary of a py-spy profile (`py-spy record --threads --format raw`:
collapsed stacks, `thread (TID): NAME;frame;...;leaf COUNT`, outermost first).

Only the event-loop thread (MainThread) is summed: in the gateway the other
threads (gRPC's poller, anyio's worker) sit blocked in epoll_wait or a
futex, which py-spy still samples, and /proc shows they use no CPU.

    python bench/flame.py profile.txt        # prints the summary
"""

from __future__ import annotations

import re
import sys
from collections import Counter

# py-spy frames: "function (path/to/file.py:LINE)", or "(lib.so)" for native ones.
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def parse(raw: str) -> list[tuple[list[str], int]]:
    stacks = []
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            stacks.append((stack.split(";"), int(count)))
    return stacks


def short(frame: str) -> str:
    """`func (file:line)` with the file cut to its package-relative tail."""
    m = _FRAME.match(frame)
    if m is None:
        return frame
    path = m.group("file")
    for marker in ("site-packages/", "/python3.11/", "/wt-bench/", "/main/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    line = m.group("line")
    return f"{m.group('func')} ({path}{':' + line if line else ''})"


def area(frame: str) -> str:
    """Where a leaf frame belongs: a library, app/..., the stdlib, or native code."""
    m = _FRAME.match(frame)
    path = m.group("file") if m else frame
    if m is not None and m.group("func") == "gc_collect_main":
        return "cyclic GC (gc_collect_main)"
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1].split("/", 1)[0].removesuffix(".py")
    if path.startswith("app/") or "/app/" in path:
        return "app/" + path.split("app/", 1)[1].split("/", 1)[0].removesuffix(".py")
    if "/python3.11/" in path or path.startswith(("asyncio/", "json/", "<frozen")):
        return "stdlib"
    if path.endswith(".py"):
        return path.split("/", 1)[0]
    return "native: " + (path.rsplit("/", 1)[-1] or "?")


def summarize(raw: str, top: int = 25) -> str:
    stacks = parse(raw)
    threads: Counter[str] = Counter()
    for frames, count in stacks:
        threads[frames[0] if frames and frames[0].startswith("thread ") else "?"] += count
    loop = next((t for t in threads if t.endswith("MainThread")), None)
    mine = [(f[1:], c) for f, c in stacks if loop is not None and f and f[0] == loop]
    total = sum(c for _, c in mine)
    if not total:
        return "(no samples of the event-loop thread)"
    leaf: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    areas: Counter[str] = Counter()
    gc_from: Counter[str] = Counter()  # the Python frame whose allocation set off the GC
    for body, count in mine:
        if not body:
            continue
        leaf[short(body[-1])] += count
        areas[area(body[-1])] += count
        names = [short(f) for f in body]
        for f in set(names):
            inclusive[f] += count
        gc_at = next((i for i, f in enumerate(names) if f.startswith("gc_collect_main")), None)
        if gc_at is not None:
            py = [f for f in names[:gc_at] if ".py" in f]
            gc_from[py[-1] if py else "?"] += count
    # Frames on nearly every stack (the loop's own run_forever and below) say nothing.
    inclusive = Counter({f: c for f, c in inclusive.items()
                         if c < 0.95 * total and (".py" in f or "gc_collect" in f)})

    def table(title: str, counter: Counter[str], n: int) -> list[str]:
        return [title] + [f"  {100 * c / total:5.1f}%  {name}"
                          for name, c in counter.most_common(n)]

    every = sum(threads.values())
    lines = [f"{total} samples of the event-loop thread ({loop}); other threads sampled: "
             + ", ".join(f"{t} {c}" for t, c in threads.items() if t != loop)
             + f" of {every} (blocked: no CPU per /proc)"]
    lines += table("self time by where the leaf frame is:", areas, 12)
    lines += table(f"top {top} frames by self time (leaf):", leaf, top)
    lines += table(f"top {top} Python frames by total time (on the stack):", inclusive, top)
    if gc_from:
        lines += table("cyclic GC, by the Python frame whose allocation triggered it "
                       "(its time is charged to that frame's total above):", gc_from, 10)
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(open(sys.argv[1]).read()))
