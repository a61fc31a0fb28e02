"""How the programs import TensorFlow and Keras (`kyu_transformer.cli.startup`)."""

import gc

import pytest

from kyu_transformer.cli.startup import import_frozen
from tests import programs
from tests.programs import ROOT

FIRST_IMPORT = """
import gc, sys
sys.path.insert(0, sys.argv[1])
from kyu_transformer.cli.startup import import_frozen
collections = []
gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info))
import_frozen()
print("tensorflow" in sys.modules and "keras" in sys.modules, len(collections), gc.isenabled(),
      gc.get_freeze_count())
"""


@pytest.mark.slow  # a fresh interpreter, as a program starts
@pytest.mark.tensorflow_only("the programs' import of TensorFlow")
def test_a_program_imports_without_collections_then_freezes_what_it_holds():
    result = programs.run("-c", FIRST_IMPORT, ROOT, fresh=True)
    assert result.returncode == 0, result.stderr[-3000:]
    imported, collections, enabled, frozen = result.stdout.split()
    assert (imported, collections, enabled) == ("True", "0", "True")
    assert int(frozen) > 100_000  # the imports' objects, out of later collections' scans


def test_a_process_that_imported_them_is_left_as_it_is():
    frozen = gc.get_freeze_count()
    import_frozen()  # Keras is imported here already
    assert gc.get_freeze_count() == frozen and gc.isenabled()
