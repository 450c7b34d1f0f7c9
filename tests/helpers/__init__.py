"""What several test rooms share, one module per concern; ``tests/`` is on ``sys.path``
(pyproject's ``pythonpath``), so a test says ``from helpers.waiting import wait_for``.
Fixtures stay in ``tests/conftest.py`` (which has pytest rewrite the asserts here); no test
module imports another."""
