"""What a run is told and how it says no: the config's typed views, the schema's check, and the one error every
stage raises.

Owns:
- ``views``: the base View and config <-> view (config_of, stage_settings, view_of, with_schema_defaults);
- ``sections``: the views of the config's sections (target, vllm, train, ...), each as small as its readers need;
- ``stages``: one model per rule (RULE_SETTINGS, ONLINE_RULE_SETTINGS): the keys its params.settings carry;
- ``schema``: a config checked against workflow/schemas/config.schema.yaml, a refusal said in a line or two;
- ``docs``: config/README.md's table of keys from the schema (``python -m eagle3_workflow.settings.docs``);
- ``errors``: StageError (the cause and the fix) and render_table, the plain-text table of logs.

May import: nothing of the package (the bottom layer, docs/architecture.md); pydantic, yaml and jsonschema only.
"""
