"""Talking to vLLM: every engine and server the stages start, and the code that runs inside vLLM's processes.

Owns:
- ``engine``: how an engine is started (ServerSpec from a stage's settings, the server's command line and
  environment, an offline engine's keyword arguments, CPU thread binding at tensor parallelism) and the names of
  vLLM's spec-decode metrics;
- ``server``: a running OpenAI server's whole life (start on a free port, readiness, fatal-log watch, teardown);
- ``cpu_server``: the CPU server's entry (``python -m eagle3_workflow.serving.cpu_server``), its EngineCore forked,
  and the same fork and frozen heap for an offline CPU engine (freeze_heap_for_cpu_engine);
- ``cpu_hs_connector``: the CPU subclass of vLLM's hidden-states connector (loaded by vLLM by its dotted name);
- ``extraction_client``: the hidden-state client of extraction and the canary (requests, file checks, progress).

May import: runtime, files, settings (docs/architecture.md); vLLM itself only inside functions or in the modules
that run in vLLM's own processes (cpu_server, cpu_hs_connector). Not reference or trainer.
"""
