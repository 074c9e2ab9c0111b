"""The control plane's writes, as operations the HTTP handlers call
(docs/architecture.md, "Folders"): each takes plain values, writes to the
store conditioned on what it read, and returns a result or raises a typed
refusal (refusals.py). No HTTP here: app/api maps refusals to problems.
"""
