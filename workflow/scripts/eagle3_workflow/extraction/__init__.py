"""Stage `extract_hidden_states`: one replica's shard of the prepared rows, through a vLLM server this stage owns.

Which module owns what:

- ``replica`` ``extract_replica``: the shard, disk preflight, resume scan, the server, the greedy probes, the manifest
  and the state progress.json ends in (the client itself is extraction_client, shared with the canary)
- ``stage``   ``main(snakemake)``, the rule's adapter
"""
