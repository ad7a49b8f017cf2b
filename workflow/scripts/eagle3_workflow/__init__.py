"""The importable package shared by the workflow's stage scripts.

Each stage has one module here with a pure function doing the work and a thin ``main(snakemake)`` adapter
that the matching ``workflow/scripts/<stage>.py`` entry calls.
"""
