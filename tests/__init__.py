"""The test suite. Imported before tests/conftest.py and every test module, so its workers skip
the imports sandkernel's own processes skip (sandkernel/imports.py: 3 s of CPU per worker)."""

from sandkernel.imports import skip_unused_slow_imports

skip_unused_slow_imports()
