"""Short loss-regression runs against recorded values (tests/assets/losses_*.json).

They catch silent changes to initialisation, data order, the LR schedule or the loss. The recorded values
come from this suite's own single-process run; other CPUs' BLAS may differ in the last bits, hence 1e-3.
To re-record after an intended change, rerun the config below and replace the JSON file.
"""

import json
import os

import pytest

from tests.distributed.common import max_abs_diff, overrides
from tests.distributed.launcher import ROOT, run_configs


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_losses_match_recorded_values(preset, tmp_path):
    with open(os.path.join(ROOT, "tests", "assets", f"losses_{preset}.json")) as f:
        recorded = json.load(f)["losses"]
    (result,) = run_configs(1, [overrides(tmp_path, preset, f"model={preset}")], tmp_path)
    gap = max_abs_diff(result["losses"], recorded)
    assert gap <= 1e-3, f"{preset}: losses moved by {gap:.2e} from the recorded run: {result['losses']}"
