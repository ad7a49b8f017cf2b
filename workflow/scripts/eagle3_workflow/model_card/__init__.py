"""Stage `package_draft`: the draft as a publishable folder with a model card made from the run's artefacts.

Which module owns what:

- ``card``  the model card (``render_model_card``) and ``package_draft`` (published_draft/)
- ``stage`` ``main(snakemake)``, the rule's adapter
"""
