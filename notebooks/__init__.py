"""Transcripts: every session recorded as a valid notebook, replayed and compared.

``recorder`` writes a session's executions and notes into one .ipynb (bounded, atomic);
``observer`` attaches it to a session as an observer of its events; ``replay`` re-runs a notebook
through the same execution path in a fresh sandbox and gives every cell a verdict; ``compare``
decides those verdicts. Imports ``kernels`` and the common base only.
"""
