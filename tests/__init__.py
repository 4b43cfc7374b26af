"""kvserve's tests read the excerpts of the evaluation data shipped in tests/data (laid out as the data folder),
never the folder itself: ``kvserve.eval.data`` and the commands the tests start see ``KVSERVE_DATA`` pointing
there. Set here, before anything imports kvserve."""

import os
from pathlib import Path

os.environ["KVSERVE_DATA"] = str(Path(__file__).resolve().parent / "data")
