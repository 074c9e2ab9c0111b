"""The gateway process: its composition root (main.py), its parts and their
start/stop order (parts.py), its settings, and what only it runs
(docs/architecture.md, "Processes")."""
