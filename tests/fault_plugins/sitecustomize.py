"""Fault injection for the gate tests: imported by every Python process started with this folder on PYTHONPATH.

EAGLE3_FAULT=shift_layers makes vLLM capture every auxiliary hidden state one layer too early (id k records
the state of id k-1), the bug class of a patched model whose layer indexing drifted. Nothing happens without
the variable, so a stray PYTHONPATH entry is harmless.
"""

import os

if os.environ.get("EAGLE3_FAULT") == "shift_layers":
    from vllm.model_executor.models import deepseek_v2, interfaces

    _mixin_set = interfaces.EagleModelMixin._set_aux_hidden_state_layers

    def _shifted_mixin(self, layers):
        _mixin_set(self, tuple(layer - 1 for layer in layers))

    interfaces.EagleModelMixin._set_aux_hidden_state_layers = _shifted_mixin

    def _shifted_deepseek(self, layers):
        self.model.aux_hidden_state_layers = tuple(layer - 1 for layer in layers)

    deepseek_v2.DeepseekV2ForCausalLM.set_aux_hidden_state_layers = _shifted_deepseek
