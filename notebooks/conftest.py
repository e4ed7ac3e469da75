"""How pytest's nbval runs these notebooks (``pytest --nbval-lax notebooks/``, or the whole suite):
each notebook's kernel is asked to exit when its notebook is done, as JupyterLab's "Shut Down
Kernel" does, instead of being killed, so that it removes its temporary files
(tests/helpers_nbval.py says which and why)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers_nbval import shut_kernels_down_gracefully  # noqa: E402

shut_kernels_down_gracefully()
