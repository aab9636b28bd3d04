"""The test suites, one package: every test module has one name (``tests.integration.stores``),
the same for pytest, mypy and the imports between suites."""
