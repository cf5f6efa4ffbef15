"""import tierfs stays light (every command, the daemon and its guard import it) and
still offers the whole data-loader API."""
import subprocess
import sys

import pytest


def run(code: str) -> str:
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_import_tierfs_loads_neither_the_direct_path_nor_the_metadata_engine():
    loaded = run("import sys, tierfs; print(' '.join(sorted(sys.modules)))").split()
    assert not {"tierfs.direct", "tierfs.hints", "tierfs.meta", "tierfs.client"} & set(loaded)


@pytest.mark.parametrize("name, kind", [("open", "function"), ("open_many", "function"),
                                        ("hint", "function"), ("HintingSampler", "type"),
                                        ("accelerate", "function")])
def test_the_api_loads_on_first_use(name, kind):
    assert run(f"import tierfs; print(type(tierfs.{name}).__name__)").strip() == kind


def test_submodules_and_star_import_work_after_import_tierfs():
    out = run("import tierfs\n"
              "print(tierfs.direct.MOUNT_BELOW > 0)\n"
              "from tierfs import *\n"
              "print(sorted(n for n in dir() if not n.startswith('_')))\n"
              "print(hasattr(tierfs, 'no_such_name'))")
    assert out.split("\n")[:3] == ["True", "['HintingSampler', 'accelerate', 'hint', "
                                   "'open_many', 'tierfs']", "False"]


def test_the_direct_path_loads_no_part_of_the_daemon():
    """A data loader's worker that opens files through tierfs.open_many loads the
    client, not the hot store, its trash and copy writers or the metadata engine."""
    loaded = set(run("import sys, tierfs; tierfs.open_many; tierfs.open\n"
                     "print(' '.join(sorted(sys.modules)))").split())
    assert "tierfs.direct" in loaded
    assert not {"tierfs.hot.store", "tierfs.hot.trash", "tierfs.hot.copy_writers",
                "tierfs.meta", "tierfs.tier", "trio", "lmdb", "boto3"} & loaded


def test_the_hot_store_is_there_for_the_daemon():
    assert run("from tierfs.hot import HotStore\nprint(HotStore.__name__)").strip() == "HotStore"
    assert run("import tierfs.hot\nprint(hasattr(tierfs.hot, 'NoSuch'))").strip() == "False"
