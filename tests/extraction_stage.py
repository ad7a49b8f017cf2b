"""One extraction replica run as its own process, as the rule runs it (runtime.stage.run_stage around
extraction.replica.extract_replica), for the tests that watch a stage from outside: kill it, stall its server, inject a
fault into a TP worker (tests/integration/test_extraction_server.py, tests/integration/test_tensor_parallel.py).

    python tests/extraction_stage.py '<json>'   keys: target, layer_ids, hidden, prepared, work, log, settings (an
                                                ExtractHiddenStatesStage as config), probe_samples (0 = the default),
                                                render_endpoint (bool)

It writes work/files (the hidden states), work/progress.json and, on success, work/manifest.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(args: dict) -> None:
    from eagle3_workflow.extraction.replica import ReplicaRequest, client_settings, extract_replica
    from eagle3_workflow.files.artefacts import write
    from eagle3_workflow.files.hidden_states import HiddenStateFiles
    from eagle3_workflow.runtime.stage import run_stage
    from eagle3_workflow.serving.engine import hidden_states_server_spec
    from eagle3_workflow.settings.stages import ExtractHiddenStatesStage

    settings = ExtractHiddenStatesStage.model_validate(args["settings"])
    work = Path(args["work"])

    def spec(storage_dir: str):
        return hidden_states_server_spec(settings, model=args["target"], layer_ids=args["layer_ids"],
                                         storage_dir=storage_dir, device="cpu",
                                         enable_render_endpoint=args["render_endpoint"])  # fmt: skip

    def body(_log) -> None:
        request = ReplicaRequest(
            prepared_dir=Path(args["prepared"]), replica=0, replicas=1,
            files=HiddenStateFiles(work / "files", len(args["layer_ids"]), args["hidden"]),
            scratch_dir=work / "scratch", progress_path=work / "progress.json", server_spec_factory=spec,
            server_log=Path(args["log"]), disk_margin=1.1,
            **({"probe_samples": args["probe_samples"]} if args["probe_samples"] else {}),
        )  # fmt: skip
        write(work / "manifest.json", extract_replica(request, client_settings(settings.extraction)))

    run_stage("extract_hidden_states", args["log"], body)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
