"""``duplexcache verify <target>`` without its reference package: exit 2 and one line, no traceback."""

from __future__ import annotations

import importlib
import sys

import pytest

from duplexcache import cli as top_cli

# target -> (the module providing its reference, the pip requirement README names)
REFERENCES = {
    "thinker": ("transformers", "transformers>=4.51"),
    "talker": ("transformers", "transformers>=4.51"),
    "audio-encoder": ("transformers", "transformers>=4.51"),
    "flow": ("stepaudio2", "minicpmo-utils==1.0.5"),
    "vision": ("transformers", "transformers>=4.51"),
}


@pytest.mark.parametrize("target", sorted(REFERENCES))
def test_verify_without_its_reference_exits_2_with_one_line(target, monkeypatch, capsys):
    module, requirement = REFERENCES[target]
    # None in sys.modules: find_spec answers None and every import of it fails, as when not installed
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)
    assert top_cli.main(["verify", target, "--preset", "tiny", "--random-weights"]) == 2
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert lines == [f"verify {target}: the reference package {requirement} is not installed (no module "
                     f"{module!r}); install it with: pip install '{requirement}' (or pip install -e '.[test]')"]
    assert "Traceback" not in captured.err


def test_every_target_declares_its_reference():
    for target, (module, requirement) in REFERENCES.items():
        verify_module = importlib.import_module(top_cli.VERIFY_TARGETS[target])
        assert verify_module.REFERENCE_PACKAGES == {module: requirement}


def test_a_broken_reference_import_exits_2(monkeypatch, capsys):
    """flow: the package is there but one of its own imports fails."""
    from duplexcache.verify import flow

    def broken():
        raise ModuleNotFoundError("No module named 'hyperpyyaml'")

    monkeypatch.setattr(flow, "missing_reference", lambda target, packages: None)
    monkeypatch.setattr(flow, "import_reference", broken)
    assert top_cli.main(["verify", "flow", "--preset", "tiny", "--random-weights"]) == 2
    assert capsys.readouterr().out.strip() == (
        "verify flow: the reference cannot be imported: ModuleNotFoundError: No module named 'hyperpyyaml'")
