"""Rules `summarize_run` and `report`: the run's figures and tables, bundled as a real Snakemake report.

Which module owns what:

- ``figures`` the SVG figures (matplotlib, imported inside the functions that draw) and the training-metrics reader
- ``pages``   the HTML table pages (pure: artefacts in, HTML text out)
- ``stage``   reading the artefacts, writing every figure and page (`summarize_run`), the nested
  ``snakemake --report`` (`build_report`), and the two rules' adapters ``summarize_main`` and ``main``
"""
