"""The names of vLLM's spec-decode metrics (LLM.get_metrics()): evaluate_draft reads acceptance from them
(evaluation/metrics.py) and check_api checks that the installed vLLM still defines them (api_checks/checks.py)."""

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POSITION_METRIC = "vllm:spec_decode_num_accepted_tokens_per_pos"
