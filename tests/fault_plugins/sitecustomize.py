"""Fault injection for the gate tests: imported by every Python process started with this folder on PYTHONPATH.

EAGLE3_FAULT=shift_layers makes vLLM capture every auxiliary hidden state one layer too early (id k records
the state of id k-1), the bug class of a patched model whose layer indexing drifted.

EAGLE3_FAULT=shift_up_if_count_kept is issue 13's bug: id k from layer k+1 whenever k+1 < N, only when that keeps
the number of ids (a no-op on a contiguous 1..K set, [2, 4, 5, 8] -> [3, 5, 6, 8] in production).

EAGLE3_FAULT=remap:<name> keeps the number and order of captured slots but fills each claimed id from another
layer (every layer 0..N is computed anyway), so only a canary that matches each slot against every layer can
tell. The remaps (`REMAPS`) cover injective, non-injective and conditional shapes; `post_norm_last` takes id N
after the final norm instead of before it; `drop_residual` takes every id without the residual added back (the
layer's own output only); `deep_off_by_one` moves only ids past the canary's 8-layer slice (every
id above 8 but the last from one layer deeper), which only the full-depth check of validate_hidden_states sees. Works for the models that capture through vLLM's EagleModelMixin
(llama, qwen3, ...) and for deepseek_v2's inline capture (DeepSeek-V3, Kimi-K2: `_remap_deepseek`). Nothing happens without the variable, so a stray PYTHONPATH entry is harmless.

EAGLE3_FAULT=accept_any_draft makes vLLM's greedy verification accept every draft token, chosen by the verifier
or not (then the bonus token after the last one): the wrong-acceptance bug class the lossless check exists for.
Both rejection samplers are patched: the V1 model runner's (CPU, and GPU runs such as n-gram) and the V2 GPU
model runner's (EAGLE-3 on CUDA).

EAGLE3_FAULT=stop_after_optimizer_step:<n> makes a training process stop itself (SIGSTOP) right after its n-th
optimizer step, inside that step (before the scheduler step and the step count), through torch's global optimizer
post-hook. A test then signals the stage, whose teardown sends SIGTERM and SIGCONT to the trainer: the stop signal
lands at exactly that point of training, whatever the machine's speed.

EAGLE3_FAULT=tp_worker_dies_at_first_forward is the story's failure: on a DeepSeek-V3-style target (vLLM's
deepseek_v2 module: DeepSeek-V3, Kimi-K2's language model) served at tensor_parallel_size >= 2, the worker of TP rank
1 (never rank 0) raises an AttributeError with an empty message from its decoder layer's call at the first forward
of real requests (a model-runner step with scheduled tokens, after the engine said it was ready; the start-up's
profile and warm-up forwards run untouched), as a wrong method name in a patched model does. Rank 0 then waits in
the layer's all-reduce for a peer that is gone, and vLLM reports nothing to the engine: only the worker's log says
it. The TP rank comes from vllm.distributed inside the worker process.

EAGLE3_FAULT=rank_raises_at_first_step:<r> makes trainer rank r (torchrun's RANK; never a process without one) raise
an AttributeError with an empty message from the first forward of a module in training mode (the draft's, at the
first step, before that step's gradient all-reduce), through torch's global forward pre-hook: the other rank then
waits in the all-reduce for a peer that is gone.

EAGLE3_FAULT=sigterm_rank_at_forward:<r>:<n> makes trainer rank r send itself SIGTERM at the start of its n-th
forward of the DDP-wrapped draft (a stop signal that reaches one rank outside a collective while the others compute:
test_a_sigterm_that_reaches_one_rank_mid_step_stops_every_rank_at_that_steps_end).

EAGLE3_FAULT=ddp_skips_gradient_sync makes every DistributedDataParallel module skip its gradient all-reduce (what
``no_sync()`` does, for the whole run): each trainer rank steps on its own gradients and the ranks' weights part.

EAGLE3_FAULT=nan_hidden_states_for_length:<n>[,<n>...] makes vLLM's hidden-states connector (the stock one on GPU,
ours on CPU: both write through the stock module's ``save_file``) write NaN hidden states for every request of exactly
n prompt tokens, the other requests untouched: a test picks rows of lengths no other row has, and those samples fail
every round of online generation.

EAGLE3_PROBE_REQUESTS_IN_FLIGHT=<folder> is a probe, not a fault: in a process that runs speculators' online dataset
(the trainer, or each DataLoader worker), it counts the hidden-state requests inside speculators'
``generate_hidden_states`` at once and writes to <folder>/in-flight-<pid>.json the highest count (``peak``), the
requests' summed seconds and the seconds with at least one in flight (their ratio: the mean in flight while busy).
The process's first request waits (at most 60 s) until a second one is in flight, so that a fetch that can run two
at once shows it whatever the machine's speed; a serial fetch records 1 after the wait. With
EAGLE3_PROBE_REQUESTS_IN_FLIGHT_NO_WAIT=1 it only counts (a bench: no request waits).

EAGLE3_PROBE_RANK_WEIGHTS=<folder> is a probe, not a fault (it combines with one): after every optimizer step, each
trainer rank (torchrun's RANK; a process without one records nothing) appends the sha256 of its parameters to
<folder>/rank<RANK>.txt, so that a test can tell whether the ranks hold the same weights.

Faults joined by "+" are installed together (EAGLE3_FAULT=shift_up_if_count_kept+remap:post_norm_last): one
server start then serves the test of two faults whose effects a gate reports apart (each slot is matched on its own).

Each fault is installed when the module it patches is first imported (`_AfterImport`), not at startup: a process
that never imports vLLM (Snakemake, most jobs) does not load it for a fault.
"""

import os
import sys

FAULT = os.environ.get("EAGLE3_FAULT", "")
CANARY_SLICE = 8  # the canary's slice on a tiny target (canary/slice.py, MIN_SHAPED_LAYERS)


def _shift_up_below_last(claimed, last):
    # issue 13: id k recorded from layer k+1 whenever k+1 < N (a no-op on a contiguous 1..K slice)
    return {k: (k + 1 if k + 1 < last else k) for k in claimed}


def _shift_down(claimed, last):
    return {k: k - 1 for k in claimed}


def _swap_first_two(claimed, last):
    out = {k: k for k in claimed}
    if len(claimed) >= 2:
        out[claimed[0]], out[claimed[1]] = claimed[1], claimed[0]
    return out


def _all_from_first(claimed, last):
    return {k: claimed[0] for k in claimed}


def _middle_off_by_one(claimed, last):
    # only the ids strictly between the first and the last one move, one layer deeper
    return {k: (k + 1 if claimed[0] < k < claimed[-1] else k) for k in claimed}


def _deep_off_by_one(claimed, last):
    # only past the canary's slice (K = 8 layers on the tiny targets): every id above 8 but the last from one layer
    # deeper, keeping the count ([2, 16, 29, 32] -> [2, 17, 30, 32] on 32 layers; nothing moves on [2, 4, 6, 8])
    return {k: (k + 1 if CANARY_SLICE < k < last else k) for k in claimed}


def _post_norm_last(claimed, last):
    return {k: ("post_norm" if k == last else k) for k in claimed}


def _drop_residual(claimed, last):
    # every id from the decoder stream without the residual added back: the delta of the layer below (the
    # `hidden_states` that vLLM's layers hand on beside `residual`), the capture of a patch that forgot `+ residual`
    return {k: ("no_residual", k) for k in claimed}


def _last_from_previous(claimed, last):
    return {k: (last - 1 if k == last else k) for k in claimed}


REMAPS = {
    "last_from_previous": _last_from_previous,
    "shift_up_below_last": _shift_up_below_last,
    "shift_down": _shift_down,
    "swap_first_two": _swap_first_two,
    "all_from_first": _all_from_first,
    "middle_off_by_one": _middle_off_by_one,
    "deep_off_by_one": _deep_off_by_one,
    "post_norm_last": _post_norm_last,
    "drop_residual": _drop_residual,
}


def _remap(name):
    remap = REMAPS[name]

    def install(interfaces):
        def remapped(self, aux_hidden_states, layer_idx, hidden_states, residual):
            claimed = tuple(sorted(self.aux_hidden_state_layers))
            if not claimed:
                return aux_hidden_states
            value = hidden_states + residual if residual is not None else hidden_states
            if layer_idx == 0:
                self._fault_stash = {}
            self._fault_stash[layer_idx] = value
            self._fault_stash[("no_residual", layer_idx)] = hidden_states
            last = len(self.layers)
            if layer_idx == last:  # the final call of a forward: emit one slot per claimed id, in id order
                self._fault_stash["post_norm"] = self.norm(value)
                sources = remap(claimed, last)
                aux_hidden_states.extend(self._fault_stash[sources[k]] for k in claimed)
                self._fault_stash = {}
            return aux_hidden_states

        interfaces.EagleModelMixin._maybe_add_hidden_state = remapped

    return install


def _accept_any_v1(v1):
    v1_sample = v1.rejection_sample

    # vLLM's own positional signature, as vLLM calls it
    def accept_any_v1(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,  # noqa: PLR0917
                      target_logits, bonus_token_ids, *args, **kwargs):  # fmt: skip
        out = v1_sample(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                        target_logits, bonus_token_ids, *args, **kwargs)  # fmt: skip
        start = 0
        for row, count in enumerate(num_draft_tokens):
            out[row, :count] = draft_token_ids[start : start + count].to(out.dtype)
            out[row, count] = bonus_token_ids[row, 0].to(out.dtype)
            start += count
        return out

    v1.rejection_sample = accept_any_v1


def _accept_any_v2(v2):
    # the V2 GPU model runner's (imported only where triton is: never on CPU)
    v2_sample = v2.rejection_sample

    def accept_any_v2(target_logits, draft_logits, draft_sampled, cu_num_logits, *args, **kwargs):
        sampled, num_sampled = v2_sample(target_logits, draft_logits, draft_sampled, cu_num_logits, *args, **kwargs)
        bounds = cu_num_logits.tolist()
        for row in range(len(bounds) - 1):
            first, end = bounds[row], bounds[row + 1]
            count = end - first - 1  # draft tokens verified for this request
            if count <= 0:
                continue
            sampled[row, :count] = draft_sampled[first + 1 : end].to(sampled.dtype)
            sampled[row, count] = target_logits[end - 1].argmax().to(sampled.dtype)
            num_sampled[row] = count + 1
        return sampled, num_sampled

    v2.rejection_sample = accept_any_v2


def _stop_after_optimizer_step(count):
    def install(optimizer_module):
        import signal

        done = [0]

        def stop_here(_optimizer, _args, _kwargs):
            done[0] += 1
            if done[0] == count:
                os.kill(os.getpid(), signal.SIGSTOP)

        optimizer_module.register_optimizer_step_post_hook(stop_here)

    return install


def _rank_raises_at_first_step(rank):
    def install(module_module):
        import time

        fired = [False]

        def raise_in_rank(module, _args):
            # the first forward of a module in training mode: the draft's, at the first training step
            if fired[0] or not module.training or os.environ.get("RANK") != str(rank):
                return
            fired[0] = True
            print(f"EAGLE3_FAULT rank_raises_at_first_step: rank {rank} raises at t={time.time():.3f}", flush=True)
            raise AttributeError()  # noqa: RSE102 -- the point: an exception whose message is empty

        module_module.register_module_forward_pre_hook(raise_in_rank)

    return install


def _ddp_skips_gradient_sync(distributed):
    ddp = distributed.DistributedDataParallel
    init = ddp.__init__

    def init_without_sync(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.require_backward_grad_sync = False  # what no_sync() sets: each rank steps on its own gradients

    ddp.__init__ = init_without_sync


def _record_rank_weights(folder):
    def install(optimizer_module):
        import hashlib

        def record(optimizer, _args, _kwargs):
            rank = os.environ.get("RANK")
            if rank is None:
                return
            digest = hashlib.sha256()
            for group in optimizer.param_groups:
                for param in group["params"]:
                    digest.update(param.detach().float().cpu().numpy().tobytes())
            with open(os.path.join(folder, f"rank{rank}.txt"), "a", encoding="utf-8") as out:
                out.write(digest.hexdigest() + "\n")

        optimizer_module.register_optimizer_step_post_hook(record)

    return install


def _sigterm_rank_at_forward(rank, count):
    def install(module_module):
        import signal
        import time

        seen = [0]

        def sigterm_here(module, _args):
            if type(module).__name__ != "DistributedDataParallel" or os.environ.get("RANK") != str(rank):
                return
            seen[0] += 1
            if seen[0] == count:
                print(
                    f"EAGLE3_FAULT sigterm_rank_at_forward: rank {rank} signals itself at t={time.time():.3f}",
                    flush=True,
                )
                os.kill(os.getpid(), signal.SIGTERM)

        module_module.register_module_forward_pre_hook(sigterm_here)

    return install


def _remap_deepseek(name):
    """The same remaps on vLLM's deepseek_v2 (DeepSeek-V3, Kimi-K2's language model), which captures inline in
    DeepseekV2Model.forward (`hidden_states + residual` before layer k, and after the last one) rather than through
    EagleModelMixin: the model is asked for the source ids the remap needs, and the claimed slots are filled from
    them. `no_residual` sources come from the outputs of the decoder layers below the claimed ids, recorded by a
    wrapper of DeepseekV2DecoderLayer.forward for those layers only (a few states, not every layer's)."""
    remap = REMAPS[name]

    def install(deepseek_v2):
        model_forward = deepseek_v2.DeepseekV2Model.forward
        layer_forward = deepseek_v2.DeepseekV2DecoderLayer.forward

        def recording_layer_forward(self, *args, **kwargs):
            out = layer_forward(self, *args, **kwargs)
            record = getattr(self, "_fault_record", None)
            if record is not None:
                record[("no_residual", self.layer_idx + 1)] = out[0]
            return out

        def forward(self, *args, **kwargs):
            claimed = tuple(sorted(self.aux_hidden_state_layers))
            if not claimed:
                return model_forward(self, *args, **kwargs)
            last = self.end_layer
            sources = remap(claimed, last)
            wanted = tuple(sorted({s for s in sources.values() if isinstance(s, int)} | {last}))
            record = {}
            below = {s[1] - 1 for s in sources.values() if isinstance(s, tuple)}
            for layer in self.layers[self.start_layer : self.end_layer]:
                if getattr(layer, "layer_idx", None) in below:
                    layer._fault_record = record
            self.aux_hidden_state_layers = wanted
            try:
                hidden_states, captured = model_forward(self, *args, **kwargs)
            finally:
                self.aux_hidden_state_layers = claimed
                for layer in self.layers[self.start_layer : self.end_layer]:
                    layer.__dict__.pop("_fault_record", None)
            record.update(zip(wanted, captured, strict=True))
            record["post_norm"] = hidden_states
            return hidden_states, [record[sources[k]] for k in claimed]

        deepseek_v2.DeepseekV2DecoderLayer.forward = recording_layer_forward
        deepseek_v2.DeepseekV2Model.forward = forward

    return install


def _claimed_ids(transform):
    """A fault that changes the ids vLLM's EagleModelMixin is told to capture: transform(model, ids) -> ids."""

    def install(interfaces):
        mixin_set = interfaces.EagleModelMixin._set_aux_hidden_state_layers

        def changed(self, layers):
            mixin_set(self, transform(self, layers))

        interfaces.EagleModelMixin._set_aux_hidden_state_layers = changed

    return install


def _one_layer_early(_model, layers):
    return tuple(layer - 1 for layer in layers)


def _shift_down_deepseek(deepseek_v2):
    def shifted_deepseek(self, layers):
        self.model.aux_hidden_state_layers = _one_layer_early(self, layers)

    deepseek_v2.DeepseekV2ForCausalLM.set_aux_hidden_state_layers = shifted_deepseek


def _up_when_count_kept(model, layers):
    # issue 13 verbatim: id k captured from layer k+1 whenever k+1 < N, applied only when that keeps the number
    # of distinct ids. On a contiguous 1..K set the shift would merge two ids, so it never fires there.
    last = len(model.layers)
    shifted = tuple(sorted({k + 1 if k + 1 < last else k for k in layers}))
    return shifted if len(shifted) == len(set(layers)) else tuple(layers)


_REAL_FORWARD = [False]  # set by the model runner's first step with scheduled tokens (this process)


def _mark_real_forwards(gpu_model_runner):
    runner = gpu_model_runner.GPUModelRunner
    execute_model = runner.execute_model

    def execute_model_marked(self, scheduler_output, *args, **kwargs):
        if scheduler_output.total_num_scheduled_tokens > 0:
            _REAL_FORWARD[0] = True
        return execute_model(self, scheduler_output, *args, **kwargs)

    runner.execute_model = execute_model_marked


def _tp_worker_dies_at_first_forward(deepseek_v2):
    import time

    from vllm.distributed import get_tensor_model_parallel_rank

    layer_forward = deepseek_v2.DeepseekV2DecoderLayer.forward

    def decoder_layer_forward(self, *args, **kwargs):
        if _REAL_FORWARD[0] and get_tensor_model_parallel_rank() == 1:
            print(f"EAGLE3_FAULT tp_worker_dies_at_first_forward: TP rank 1 raises at t={time.time():.3f}", flush=True)
            raise AttributeError()  # noqa: RSE102 -- the point: an exception whose message is empty
        return layer_forward(self, *args, **kwargs)

    deepseek_v2.DeepseekV2DecoderLayer.forward = decoder_layer_forward


def _nan_hidden_states_for_length(lengths):
    def install(connector):
        import torch

        save = connector.save_file

        def save_nan_for_length(tensors, filename, *args, **kwargs):
            if tensors["token_ids"].shape[0] in lengths:
                tensors = {**tensors, "hidden_states": torch.full_like(tensors["hidden_states"], float("nan"))}
            return save(tensors, filename, *args, **kwargs)

        connector.save_file = save_nan_for_length

    return install


def _record_requests_in_flight(folder):
    def install(data):
        import json
        import threading
        import time

        generate = data.generate_hidden_states
        wait = not os.environ.get("EAGLE3_PROBE_REQUESTS_IN_FLIGHT_NO_WAIT")
        state = {"now": 0, "peak": 0, "held": not wait, "request_s": 0.0, "busy_s": 0.0, "busy_since": 0.0}
        changed = threading.Condition()
        path = os.path.join(folder, f"in-flight-{os.getpid()}.json")

        def record():
            os.makedirs(folder, exist_ok=True)
            with open(path, "w") as out:
                json.dump({key: state[key] for key in ("peak", "request_s", "busy_s")}, out)

        def counted(*args, **kwargs):
            with changed:
                state["now"] += 1
                if state["now"] == 1:
                    state["busy_since"] = time.monotonic()
                if state["now"] > state["peak"]:
                    state["peak"] = state["now"]
                    record()
                changed.notify_all()
                if not state["held"]:
                    state["held"] = True
                    changed.wait_for(lambda: state["now"] >= 2, timeout=60)
            started = time.monotonic()
            try:
                return generate(*args, **kwargs)
            finally:
                with changed:
                    now = time.monotonic()
                    state["now"] -= 1
                    state["request_s"] += now - started
                    if state["now"] == 0:
                        state["busy_s"] += now - state["busy_since"]
                    record()

        data.generate_hidden_states = counted

    return install


class _AfterImport:
    """A sys.meta_path finder that runs hooks[name](module) right after module `name` is executed, before whoever
    imported it gets it back. A process that never imports the patched module (Snakemake, a job's script, a
    stage's helpers) never loads vLLM or torch for a fault: importing them up front cost every Python process of
    a fault test ~10 s."""

    def __init__(self, hooks):
        self.hooks = dict(hooks)

    def find_spec(self, name, path, target=None):
        hook = self.hooks.pop(name, None)
        if hook is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            hook(module)

        spec.loader.exec_module = exec_module
        return spec


INTERFACES = "vllm.model_executor.models.interfaces"
CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"


def _hooks(fault):
    """{module: install} for one fault."""
    if fault == "shift_layers":
        return {
            INTERFACES: _claimed_ids(_one_layer_early),
            "vllm.model_executor.models.deepseek_v2": _shift_down_deepseek,
        }
    elif fault == "shift_up_if_count_kept":
        return {INTERFACES: _claimed_ids(_up_when_count_kept)}
    elif fault == "accept_any_draft":
        return {
            "vllm.v1.sample.rejection_sampler": _accept_any_v1,
            "vllm.v1.worker.gpu.spec_decode.rejection_sampler": _accept_any_v2,
        }
    elif fault.startswith("remap:"):
        name = fault.split(":", 1)[1]
        return {INTERFACES: _remap(name), "vllm.model_executor.models.deepseek_v2": _remap_deepseek(name)}
    elif fault == "tp_worker_dies_at_first_forward":
        return {
            "vllm.v1.worker.gpu_model_runner": _mark_real_forwards,
            "vllm.model_executor.models.deepseek_v2": _tp_worker_dies_at_first_forward,
        }
    elif fault.startswith("stop_after_optimizer_step:"):
        return {"torch.optim.optimizer": _stop_after_optimizer_step(int(fault.split(":", 1)[1]))}
    elif fault.startswith("rank_raises_at_first_step:"):
        return {"torch.nn.modules.module": _rank_raises_at_first_step(int(fault.split(":", 1)[1]))}
    elif fault.startswith("sigterm_rank_at_forward:"):
        _rank, _count = fault.split(":", 1)[1].split(":")
        return {"torch.nn.modules.module": _sigterm_rank_at_forward(int(_rank), int(_count))}
    elif fault.startswith("nan_hidden_states_for_length:"):
        return {CONNECTOR: _nan_hidden_states_for_length({int(n) for n in fault.split(":", 1)[1].split(",")})}
    elif fault == "ddp_skips_gradient_sync":
        return {"torch.nn.parallel.distributed": _ddp_skips_gradient_sync}
    else:
        return {}


def _both(first, second):
    def install(module):
        first(module)
        second(module)

    return install


# faults joined by "+" are installed together (each on its own module, or one after the other on the same one): one
# server start serves tests of two faults whose effects the gate reports apart, e.g.
# shift_up_if_count_kept+remap:post_norm_last (ids 2, 4, 6 one layer deeper and id 8 after the final norm)
HOOKS = {}
for _fault in filter(None, FAULT.split("+")):
    for _module, _install in _hooks(_fault).items():
        HOOKS[_module] = _both(HOOKS[_module], _install) if _module in HOOKS else _install
if os.environ.get("EAGLE3_PROBE_RANK_WEIGHTS"):  # a probe, not a fault: combined with any of the above
    _fault_hook = HOOKS.get("torch.optim.optimizer")
    _probe_hook = _record_rank_weights(os.environ["EAGLE3_PROBE_RANK_WEIGHTS"])

    def _optimizer_hooks(module):
        if _fault_hook is not None:
            _fault_hook(module)
        _probe_hook(module)

    HOOKS["torch.optim.optimizer"] = _optimizer_hooks
if os.environ.get("EAGLE3_PROBE_REQUESTS_IN_FLIGHT"):  # a probe, not a fault: no fault patches this module
    HOOKS["speculators.train.data"] = _record_requests_in_flight(os.environ["EAGLE3_PROBE_REQUESTS_IN_FLIGHT"])
if HOOKS:
    sys.meta_path.insert(0, _AfterImport(HOOKS))
