"""Files on disk: what the stages write and read, each thing with one reader and one writer.

Owns:
- ``artefacts``: the JSON contracts between stages (pydantic models, `write` atomic, `load` checked) and a gate's
  row and table (CheckRow, check_table); the models themselves by what they describe: ``target_artefacts`` (the
  target and the API), ``data_artefacts`` (the training data and its gates), ``draft_artefacts`` (training,
  evaluation, provenance);
- ``hidden_states``: the hidden-state files (hs_<row>.safetensors): naming, reading, checking, sizes;
- ``target_weights``: the target checkpoint's weight map (model.safetensors.index.json), read and written;
- ``prepared``: the prepared (tokenized) dataset;
- ``chat``: conversations as the target's chat template renders and tokenizes them (the prepared data's shape);
- ``writing``: atomic writes, the umask a shared run honours, publishing a folder whole;
- ``disk``: a full disk or quota recognised in an exception or a log line, and the space left.

May import: settings (docs/architecture.md, for errors.StageError); torch, safetensors, datasets, pydantic. Nothing
here starts a process or reads the config.
"""
