"""A plain transformers forward of one sample, every state in vLLM's layer-id convention (layer_match): what the
reference tests (tests/unit/test_full_depth.py, tests/unit/test_quantized_reference.py) compare the streamed
reference with."""

from __future__ import annotations

import torch

from eagle3_workflow.reference.layer_match import POST_NORM


def hf_forward_states(model, ids: list[int]) -> dict[str, torch.Tensor]:
    """label -> [T, H]: str(k) the input of layer k (output_hidden_states[k]), str(N) the last layer's pre-norm output
    (a hook on it), POST_NORM the final norm's output (output_hidden_states[N])."""
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda _m, _a, out: captured.__setitem__("last", out[0] if isinstance(out, tuple) else out)
    )
    try:
        with torch.inference_mode():
            hidden = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    n = len(model.model.layers)
    return {**{str(k): hidden[k][0] for k in range(n)}, str(n): captured["last"][0], POST_NORM: hidden[n][0]}
