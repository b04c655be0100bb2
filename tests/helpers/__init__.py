"""What several test modules share: brokers, services and rigs to run them, fixtures, figures.

No test module imports another (tests/test_architecture.py checks it): what two of them need
lives here, named without the ``test_`` prefix so that pytest does not collect it. The fixtures
here are every test's, through ``pytest_plugins`` in tests/conftest.py."""
