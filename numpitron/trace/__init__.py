"""Traces of real runs in the Chrome Trace Event Format (Perfetto, chrome://tracing):
every rank's computation and communication on one aligned clock (docs/19-traces.md).
Tracing wraps a built run from outside; with --trace off nothing of it is installed."""
