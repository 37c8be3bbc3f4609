"""Proves the package's ``msgspec.Struct`` records take their defaults as msgspec reads them:
no field's default is written with ``dataclasses.field`` (msgspec would keep the ``Field``
object itself as the default value, silently: a record made without that field would carry
it, as ``Plan.engine_fields`` once did), and each module that declares one imports
``msgspec``. An AST walk of ``sidecar/``, nothing imported. Does not prove the records'
behaviour (their modules' suites do)."""

from __future__ import annotations

import ast
from pathlib import Path

SIDECAR = Path(__file__).resolve().parents[1] / "sidecar"


def struct_defaults(source: str) -> list[tuple[str, str, str]]:
    """(class, field, default) of every defaulted field of a ``msgspec.Struct`` subclass."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        if not any(ast.unparse(base) == "msgspec.Struct" for base in node.bases):
            continue
        for statement in node.body:
            if isinstance(statement, ast.AnnAssign) and statement.value is not None:
                out.append((node.name, ast.unparse(statement.target),
                            ast.unparse(statement.value)))
    return out


def misplaced_fields(source: str) -> list[str]:
    return [f"{cls}.{name} = {default}" for cls, name, default in struct_defaults(source)
            if "field(" in default and not default.startswith("msgspec.field(")]


def test_the_checker_sees_a_dataclass_field_in_a_struct() -> None:
    wrong = ("import msgspec\nfrom dataclasses import field\n"
             "class R(msgspec.Struct, frozen=True):\n"
             "    a: int\n    b: dict = field(default_factory=dict)\n")
    right = wrong.replace("= field(", "= msgspec.field(")
    assert misplaced_fields(wrong) == ["R.b = field(default_factory=dict)"]
    assert misplaced_fields(right) == []


def test_no_struct_default_is_a_dataclass_field() -> None:
    found = {str(path.relative_to(SIDECAR)): misplaced
             for path in SIDECAR.rglob("*.py")
             if (misplaced := misplaced_fields(path.read_text()))}
    assert not found, f"dataclasses.field in a msgspec.Struct: {found}"


def test_the_per_request_records_are_structs() -> None:
    # The records made for every request (docs/developing/benchmarks.md says why).
    expected = {
        "protocol/request.py": {"ClientRequest"},
        "protocol/context.py": {"HandoffContext"},
        "request/legs.py": {"PDRequest"},
        "request/placement.py": {"Decision", "Facts", "PromptFacts", "MoveFacts"},
        "request/migration.py": {"Plan"},
        "engines/calls.py": {"PrefillLeg"},
        "targets/breaker.py": {"Admission"},
    }
    for module, classes in expected.items():
        tree = ast.parse((SIDECAR / module).read_text())
        declared = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
                    and any(ast.unparse(base) == "msgspec.Struct" for base in node.bases)}
        assert classes <= declared, (module, classes - declared)
