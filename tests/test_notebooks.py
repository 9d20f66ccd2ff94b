"""Execute every notebook in notebooks/ top to bottom (nbclient, a fresh python3 kernel, a temporary
working directory). A cell that raises fails the test with the cell's traceback."""
import glob
import os

import nbclient
import nbformat
import pytest

import fadev

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
FADEV_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(fadev.__file__)))


def test_notebooks_exist():
    assert [os.path.basename(p) for p in NOTEBOOKS][:1] == ["01_formats_tour.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, tmp_path, monkeypatch):
    # the kernel imports the fadev these tests import (installed, or built in place), and writes nothing here
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [FADEV_PARENT, os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    if os.path.basename(path) == "01_formats_tour.ipynb":
        text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
        assert "256 of 256 patterns decode as ml_dtypes does" in text and "round trip: True" in text
        assert sum("image/png" in o.get("data", {}) for o in outputs) == 2  # both figures rendered
    if os.path.basename(path) == "05_shadow_monitor.ipynb":  # the monitored training ran and was plotted
        text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
        assert "SDPA calls seen" in text and "fa2:fp8_e4m3  largest rel_rms" in text
        assert sum("image/png" in o.get("data", {}) for o in outputs) == 1
