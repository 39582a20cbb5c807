"""Shared pytest options: ``--autopar-update-golden`` rewrites golden plan files instead of
failing on a mismatch (see autopar.regression)."""

import os

from autopar.regression import UPDATE_ENV


def pytest_addoption(parser):
    parser.addoption("--autopar-update-golden", action="store_true", default=False,
                     help="rewrite tests/golden/*.json plans that are missing or no longer match")


def pytest_configure(config):
    if config.getoption("--autopar-update-golden"):
        os.environ[UPDATE_ENV] = "1"
