"""Configuration without the engine: building and validating an `EngineConfig` (and importing
`jaxpaged.spec_decode`) loads neither the worker nor a draft model."""

import os
import subprocess
import sys

import pytest

from jaxpaged.spec_decode import PROPOSERS, proposer_factory, register_proposer


def _loaded_after(code: str) -> list[str]:
    """The jaxpaged.worker and draft-model modules loaded once `code` ran in a fresh process."""
    probe = (f"{code}\nimport sys\nprint(sorted(m for m in sys.modules "
             "if m.startswith('jaxpaged.worker') or m == 'jaxpaged.spec_decode.draft_model'))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert out.returncode == 0, out.stderr
    return eval(out.stdout.strip().splitlines()[-1])


def test_importing_the_config_loads_no_worker():
    assert _loaded_after("import jaxpaged.config") == []


def test_importing_spec_decode_loads_no_draft_model_nor_worker():
    assert _loaded_after("import jaxpaged.spec_decode; "
                         "from jaxpaged.spec_decode import SpeculativeConfig") == []


def test_creating_the_engine_config_loads_no_worker(tiny_model_dir):
    code = ("from jaxpaged.engine.arg_utils import EngineArgs\n"
            f"c = EngineArgs({str(tiny_model_dir)!r}, speculative_config={{'method': 'ngram'}}"
            ").create_engine_config()\nassert c.speculative.method == 'ngram'")
    assert _loaded_after(code) == []


def test_the_draft_model_names_are_still_importable():
    from jaxpaged.spec_decode import DraftModelProposer, build_draft_model_proposer

    assert proposer_factory("draft_model") is build_draft_model_proposer
    assert DraftModelProposer.__name__ == "DraftModelProposer"


def test_a_proposer_registered_by_path_is_imported_on_first_use():
    register_proposer("lazy_ngram", "jaxpaged.spec_decode.ngram:NgramProposer")
    try:
        assert PROPOSERS["lazy_ngram"] == "jaxpaged.spec_decode.ngram:NgramProposer"
        from jaxpaged.spec_decode.ngram import NgramProposer

        assert proposer_factory("lazy_ngram") is NgramProposer
        with pytest.raises(ValueError, match="'module:name'"):
            register_proposer("bad", "no_colon")
    finally:
        del PROPOSERS["lazy_ngram"]
