"""How every llmgw process logs: `llmgw serve` and `llmgw agent` both call
`configure()` (app/cli.py), so their lines look alike.

* `LLMGW_LOG_FORMAT=text` (the default): `TIME LEVEL LOGGER: MESSAGE`, then
  the record's extra fields as ` name=value` (the request id, the access
  line's fields). A client writes into lines (the access line's path is
  uvicorn's decoding of `%0a` and the like), so nothing unprintable is
  written as it is: in the message, a character Python does not call
  printable (a line end, an escape) is written as in a Python string
  (`\n`, `\x1b`, `\u2028`); a field's value holding one, or a space, is
  written as a JSON string. A traceback stays below its line, as written.
* `LLMGW_LOG_FORMAT=json`: one JSON object a line, `time` (ISO 8601 UTC,
  milliseconds), `level`, `logger`, `message`, the extra fields, and an
  exception's traceback as `exc_info`: what a log shipper (Vector, Fluent
  Bit, Loki's promtail) reads without a parsing rule.

`request_id` holds the id of the `/v1` request the running task serves (the
router sets it, app/router/access.py); a filter on the handler puts it on
every record logged while it is set, whichever logger wrote it. A context
variable, so each request's task, and the tasks it starts, see their own.

Uvicorn's loggers are made to propagate here (`uvicorn.Config(log_config=
None)` in the CLI), so its lines take the same format. No secret is ever
passed to a logger: the access line names a client key by its id.
docs/design/logs.md.
"""

from __future__ import annotations

import atexit
import json
import logging
import logging.handlers
import queue
import sys
import threading
import time
from contextvars import ContextVar
from typing import Any

FORMATS = ("text", "json")

request_id: ContextVar[str | None] = ContextVar("request_id", default=None)

# What every LogRecord has: anything else on one came from `extra=` or a filter.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName",
    "color_message"}  # uvicorn's copy of its message with terminal colours


class RequestIdFilter(logging.Filter):
    """Puts the current request's id on the record, when there is one."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = request_id.get()
        if rid is not None and not hasattr(record, "request_id"):
            record.request_id = rid
        return True


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    """The record's own fields, the request id first (the filter adds it last)."""
    extras = {k: v for k, v in vars(record).items() if k not in _STANDARD}
    rid = extras.pop("request_id", None)
    return extras if rid is None else {"request_id": rid, **extras}


class TextFormatter(logging.Formatter):
    """The classic line, then the extra fields as name=value."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        return line if line.isprintable() else _escaped(line)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = _extras(record)
        if not extras:
            return line
        fields = " ".join(f"{k}={_text(v)}" for k, v in extras.items())
        head, sep, rest = line.partition("\n")  # a traceback stays below the fields
        return f"{head} {fields}{sep}{rest}"


def _escaped(s: str) -> str:
    """`s`, its unprintable characters written as in a Python string."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)


def _text(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}"
    s = str(value)
    return json.dumps(s) if (" " in s or not s or not s.isprintable()) else s


class JsonFormatter(logging.Formatter):
    """One JSON object a line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": _iso(record.created),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for k, v in _extras(record).items():
            out.setdefault(k, v)
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        line = json.dumps(out, default=str, ensure_ascii=False)
        # JSON leaves these three as they are; Python's splitlines() (and
        # some readers) end a line at each.
        return line if line.isascii() else line.translate(_LINE_ENDS)


_LINE_ENDS = {ord(c): f"\\u{ord(c):04x}" for c in "\x85\u2028\u2029"}


def _iso(created: float) -> str:
    seconds = int(created)
    millis = int((created - seconds) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


def handler(fmt: str, stream: Any = None) -> logging.StreamHandler[Any]:
    """A stream handler writing `fmt` ("text" or "json"), request ids added."""
    if fmt not in FORMATS:
        raise ValueError(f"LLMGW_LOG_FORMAT must be one of {', '.join(FORMATS)}, not {fmt!r}")
    h = logging.StreamHandler(stream or sys.stderr)
    h.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    h.addFilter(RequestIdFilter())
    return h


class _Enqueue(logging.handlers.QueueHandler):
    """Hands records to the writer thread as they are: formatted there, the
    exception a field of the JSON line (the stock `prepare` would format it
    here, into the message)."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record


class _Writer:
    """The thread that formats and writes the queued records, in batches:
    woken by the first record after a batch, it waits `every` s for the
    rest and writes what came in one call, not a call a record (a record
    put to the queue while the thread waits out a batch costs the event
    loop no system call), and with nothing queued it sleeps until the next
    record: an idle gateway's writer never wakes."""

    def __init__(self, queued: queue.SimpleQueue[logging.LogRecord | None],
                 out: logging.StreamHandler[Any], every: float) -> None:
        self.queued, self.out, self.every = queued, out, every
        self.wakes = 0  # batches written (tests/test_logs.py)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmgw-log-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            first = self.queued.get()  # asleep until a record, or the stop's None
            self.wakes += 1
            if first is not None:
                self._stopping.wait(self.every)  # the rest of the batch comes meanwhile
            if not self._write(first):
                return

    def _write(self, first: logging.LogRecord | None) -> bool:
        """Writes `first` and what else is queued; False once the stop's
        None was among them (all before it written)."""
        records = [first]
        while True:
            try:
                records.append(self.queued.get_nowait())
            except queue.Empty:
                break
        lines = []
        for record in records:
            if record is None:
                continue
            try:
                lines.append(self.out.format(record) + self.out.terminator)
            except Exception:
                self.out.handleError(record)
        if lines:
            try:
                self.out.stream.write("".join(lines))
                self.out.flush()
            except Exception:
                self.out.handleError(logging.makeLogRecord({"msg": "log lines not written"}))
        return None not in records

    def stop(self) -> None:
        """Writes what is queued; the thread ends."""
        self._stopping.set()
        self.queued.put(None)
        self._thread.join()


_writer: _Writer | None = None


def configure(level: str, fmt: str, stream: Any = None, every: float = 0.05) -> None:
    """The root logger writes `fmt` to stderr (or `stream`) at `level` (a
    name: "info").

    The event loop only makes each record and queues it: a thread formats
    and writes them, what came within `every` s in one write, so a slow
    stderr (a full pipe to a log shipper) never stalls requests, and a line
    costs the loop a few microseconds and no system call
    (docs/design/logs.md). The record's caller, thread and process names
    are not looked up (the logging HOWTO's "Optimization"): no line shows
    them. `stop()` writes what is queued (also run at exit)."""
    global _writer
    stop()
    logging._srcfile = None  # no frame walk per record for funcName/lineno
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    out = handler(fmt, stream)
    out.removeFilter(out.filters[0])  # the request id is read in the request's task
    queued: queue.SimpleQueue[logging.LogRecord | None] = queue.SimpleQueue()
    enqueue = _Enqueue(queued)
    enqueue.addFilter(RequestIdFilter())
    root.addHandler(enqueue)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    _writer = _Writer(queued, out, every)
    atexit.register(stop)


def stop() -> None:
    """Writes the queued records and stops the writer thread; later records
    are written as they are made, on the caller's thread. Called where the
    process may end without its exit handlers (a signal raised again),
    which would lose what is still queued."""
    global _writer
    if _writer is None:
        return
    writer, _writer = _writer, None
    root = logging.getLogger()
    for queued in [h for h in root.handlers if isinstance(h, _Enqueue)]:
        root.removeHandler(queued)
    writer.stop()  # what was queued, before a line written directly
    out = writer.out
    out.addFilter(RequestIdFilter())  # read here now, on the record's own thread
    root.addHandler(out)
