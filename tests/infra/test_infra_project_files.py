"""Pulumi.yaml declares every key once, with its default; the example stacks use only those keys."""

from __future__ import annotations

import pytest
from infra_harness import INFRA_DIR

from clipforge_infra.settings import CONFIG_KEYS, SECRET_KEYS, parse_settings
from clipforge_infra.stack_files import (
    available_stacks,
    is_secure,
    load_declarations,
    load_stack_values,
    program_config,
    undeclared_keys,
)

# No default by decision: the image comes from docker/image.env via make up, the SSH key is yours.
KEYS_WITHOUT_DEFAULT = {"image", "sshAuthorizedKeys"}
EXAMPLES = [stack for stack in available_stacks(INFRA_DIR) if stack.startswith("example-")]


def test_pulumi_yaml_declares_exactly_the_keys_the_program_reads():
    """The config schema and the program's key list are the same set."""
    assert set(load_declarations(INFRA_DIR)) == set(CONFIG_KEYS)


def test_every_key_has_type_description_and_default_where_one_makes_sense():
    """Each declaration has a type and a description; all but the image and SSH key have a default."""
    declarations = load_declarations(INFRA_DIR)
    for key, declaration in declarations.items():
        assert declaration.type in ("string", "integer", "boolean", "array"), key
        assert declaration.description, key
        assert declaration.has_default == (key not in KEYS_WITHOUT_DEFAULT), key


def test_defaults_parse_into_valid_settings():
    """Pulumi.yaml's defaults alone (plus image and key) pass validation: the defaults are usable."""
    config = program_config(
        load_declarations(INFRA_DIR),
        {
            "image": "registry.example/clipforge:1.0",
            "sshAuthorizedKeys": "ssh-ed25519 AAAAC3Nza user@host",
        },
    )
    settings = parse_settings(config, secret_keys=set(SECRET_KEYS))
    assert settings.workers.num_workers >= 1 and not settings.released


def test_there_are_one_node_and_multi_node_examples():
    """The examples cover a 1x4-GPU and a 2x8-GPU setup."""
    shapes = {
        (
            load_stack_values(INFRA_DIR, s)["numWorkers"],
            load_stack_values(INFRA_DIR, s)["gpusPerWorker"],
        )
        for s in EXAMPLES
    }
    assert {(1, 4), (2, 8)} <= shapes


@pytest.mark.parametrize("stack", EXAMPLES)
def test_example_stacks_set_only_declared_keys_and_no_plain_secrets(stack):
    """No typo'd key, no secret in clear, no image (make up supplies it) in the examples."""
    values = load_stack_values(INFRA_DIR, stack)
    assert undeclared_keys(load_declarations(INFRA_DIR), values) == []
    assert all(is_secure(values[key]) for key in SECRET_KEYS if key in values)
    assert "image" not in values and "released" not in values
