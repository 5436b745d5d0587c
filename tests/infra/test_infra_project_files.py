"""Pulumi.yaml declares every key once, with its default, and agrees with StackConfig's
declarations (type, doc); the example stacks use only those keys."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from infra_harness import INFRA_DIR, program_values

from clipforge_infra.settings import (
    CONFIG_KEYS,
    SECRET_KEYS,
    declaration_problems,
    declarations,
    described,
    parse_settings,
)
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


def _pulumi_config(text: str) -> dict:
    return yaml.safe_load(text)["config"]


def test_every_key_has_one_declaration_whose_type_and_doc_pulumi_yaml_shows():
    """Each Pulumi.yaml key is declared exactly once in StackConfig, with Pulumi.yaml's type, and
    its description there is the declaration's doc, word for word: the doc has one source."""
    text = (INFRA_DIR / "Pulumi.yaml").read_text(encoding="utf-8")
    assert declaration_problems(_pulumi_config(text)) == []
    assert all(declared.doc for declared in declarations())


DESCRIPTION = "    description: CPU for TensorBoard (requests = limits)\n"
TENSORBOARD_CPU = "  tensorboardCpu:\n    type: string\n" + DESCRIPTION + '    default: "1"\n'


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        ((DESCRIPTION, ""), "tensorboardCpu: no description in Pulumi.yaml; its doc is: CPU for"),
        (
            (DESCRIPTION, DESCRIPTION.replace("CPU", "Cores")),
            "tensorboardCpu: Pulumi.yaml's description is not StackConfig's doc",
        ),
        (
            (TENSORBOARD_CPU, ""),
            "tensorboardCpu: declared in StackConfig, missing from Pulumi.yaml",
        ),
        (
            ("    type: string\n" + DESCRIPTION, "    type: integer\n" + DESCRIPTION),
            "tensorboardCpu: Pulumi.yaml's type is 'integer'",
        ),
        (
            (TENSORBOARD_CPU, TENSORBOARD_CPU + "  tensorboardGpu:\n    type: string\n"),
            "tensorboardGpu: in Pulumi.yaml, not declared",
        ),
    ],
)
def test_the_declaration_check_catches_a_deleted_doc_key_or_type(edit, problem):
    """Deleting a key's description (or the whole key) from Pulumi.yaml, changing its type, or
    adding a key StackConfig does not declare is one problem naming the key."""
    text = (INFRA_DIR / "Pulumi.yaml").read_text(encoding="utf-8")
    assert edit[0] in text
    problems = declaration_problems(_pulumi_config(text.replace(*edit, 1)))
    assert len(problems) == 1 and problems[0].startswith(problem), problems


def test_pulumi_yaml_descriptions_are_written_from_the_docs():
    """`python -m clipforge_infra.settings --write` leaves Pulumi.yaml as it is, and puts back a
    description edited by hand: Pulumi.yaml's descriptions are generated from the schema."""
    text = (INFRA_DIR / "Pulumi.yaml").read_text(encoding="utf-8")
    assert described(text) == text
    assert described(text.replace(DESCRIPTION, DESCRIPTION.replace("CPU", "Cores"))) == text


def test_the_declaration_check_catches_an_empty_doc_or_a_key_declared_twice():
    """A declaration without a doc, or two declarations of one key, is a problem too."""
    pulumi_config = _pulumi_config((INFRA_DIR / "Pulumi.yaml").read_text(encoding="utf-8"))
    declared = declarations()
    undocumented = tuple(
        dataclasses.replace(d, doc="") if d.key == "shmSize" else d for d in declared
    )
    assert declaration_problems(pulumi_config, undocumented) == [
        "shmSize: StackConfig's doc is empty"
    ]
    assert declaration_problems(pulumi_config, (*declared, declared[0])) == [
        f"{declared[0].key}: declared 2 times"
    ]


def test_every_key_has_type_description_and_default_where_one_makes_sense():
    """Each declaration has a type and a description; all but the image and SSH key have a default."""
    declarations = load_declarations(INFRA_DIR)
    for key, declaration in declarations.items():
        assert declaration.type in ("string", "integer", "boolean", "array"), key
        assert declaration.description, key
        assert declaration.has_default == (key not in KEYS_WITHOUT_DEFAULT), key


def test_defaults_parse_into_valid_settings():
    """Pulumi.yaml's defaults alone (plus image and key) pass validation: the defaults are usable.
    parse_settings takes them as plain values, exactly what Pulumi's typed getters return."""
    set_by_user = {
        "image": "registry.example/clipforge:1.0",
        "sshAuthorizedKeys": "ssh-ed25519 AAAAC3Nza user@host",
    }
    declared = load_declarations(INFRA_DIR)
    plain = {key: d.default for key, d in declared.items() if d.has_default} | set_by_user
    settings = parse_settings(plain, set(SECRET_KEYS))
    assert settings.workers.num_workers >= 1 and not settings.released
    assert program_values(program_config(declared, set_by_user), set(SECRET_KEYS)) == plain


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
