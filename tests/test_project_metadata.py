"""pyproject.toml builds with the setuptools the project requires, without deprecation warnings
(a deprecated form, such as `license = {text = ...}`, stops building on a date setuptools names)."""

from __future__ import annotations

import warnings

from setuptools import Distribution
from setuptools.config.pyprojecttoml import apply_configuration
from setuptools.warnings import SetuptoolsDeprecationWarning

from tests.conftest import REPO


def test_pyproject_metadata_has_no_deprecated_forms():
    """Reading the metadata raises no SetuptoolsDeprecationWarning; the licence is an SPDX id."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", SetuptoolsDeprecationWarning)
        dist = apply_configuration(Distribution(), REPO / "pyproject.toml")
    assert dist.metadata.license_expression == "Apache-2.0"
